"""kvtier loadgen: exact percentiles, and a small fleet against a live server via the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_proc import ROOT, Server

from kvtier.loadgen import percentile, summarize


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([], 50) is None
    assert summarize([0.001, 0.002]) == {"n": 2, "p50": 1.0, "p95": 2.0, "p99": 2.0, "mean": 1.5}


def test_fleet_against_live_server_writes_json_and_png(tmp_path: Path) -> None:
    args = ("--l1-bytes", "32MiB", "--l2-bytes", "32MiB")
    srv = Server(tmp_path / "l3", *args, module="ops.cli serve").start()  # the cache's metrics
    try:
        out, png = tmp_path / "r.json", tmp_path / "r.png"
        cmd = [sys.executable, "-m", "ops.cli", "loadgen", "--url", srv.url, "--sessions", "4"]
        cmd += ["--turns", "3", "--think-ms", "200", "--max-tokens", "8", "--system-chars", "800"]
        cmd += ["--compare", "2", "--out", str(out), "--png", str(png)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "\noverall " in done.stdout and "restore is" in done.stdout
        result = json.loads(out.read_text())
        assert result["requests"] == 12 and result["ok"] == 12 and result["errors"] == {}
        by_source = result["ttft_ms"]["by_source"]
        assert sum(s["n"] for s in by_source.values()) == 12
        # Turns 2 and 3 of every session find their own conversation in the cache.
        assert by_source.get("l1", {"n": 0})["n"] >= 8
        assert result["itl_ms"]["overall"]["n"] == 12 * 7
        assert result["compare"]["n"] == 2
        # Server-side TTFT from the server's /metrics, over the fleet's requests only (the
        # probes come after the second scrape), beside the client-side figure.
        server = result["server_ttft_ms"]
        assert server["overall"]["n"] == 12, server
        assert sum(s["n"] for src, s in server.items() if src != "overall") == 12
        assert set(server) - {"overall"} <= set(by_source)
        assert "server-side" in done.stdout and "queue wait" in done.stdout
        assert result["metrics_error"] is None
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # The probes' fresh tenants are deleted after the comparison.
        assert result["compare"]["probe_tenants"]["deleted"] == 2, result["compare"]
        assert result["compare"]["probe_tenants"]["error"] is None
        assert "probe tenants deleted after: 2" in done.stdout
        # "after the run": the counters' change over this run, not since the server started.
        first = result["tiers"]
        assert first["counted"] == "during the run"
        assert sum(first["restore_decisions"].values()) >= 12, first  # a decision per turn
        assert "(hits and restores: during the run" in done.stdout
        again = [*cmd[: cmd.index("--sessions") + 1], "1", "--turns", "1", "--compare", "0"]
        again += ["--out", str(tmp_path / "again.json"), "--png", str(tmp_path / "again.png")]
        assert subprocess.run(again, cwd=ROOT, capture_output=True, timeout=300).returncode == 0
        second = json.loads((tmp_path / "again.json").read_text())["tiers"]
        # one request: at most one restore decision and fewer hits than the whole first run
        assert sum(second["restore_decisions"].values()) <= 1, second
        assert sum(second["hits_by_tier"].values()) < sum(first["hits_by_tier"].values())
    finally:
        assert srv.stop() == 0
    from kvtier.tiers.l3 import L3Store

    with L3Store(tmp_path / "l3", read_only=True) as store:
        tenants = {r.header.tenant for r in store.index.iter_chunks(order_lru=True)}
    assert tenants and not [t for t in tenants if t.startswith("probe-")], tenants


def end_after_x(root: Path) -> Path:
    """The built-in model's shape and tokenizer, saved with weights that make it a bigram
    model: every layer adds nothing to the residual (o_proj and down_proj are zero), so the
    logits depend on the last token alone. Greedy, a reply is "x", then the end token, then
    "y" for ever: it ends after two tokens unless the end token is ignored."""
    import torch

    from kvtier.server.devices.model import build_default

    served = build_default("cpu")
    model, eos = served.model, 256
    x, y = ord("x"), ord("y")
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w.zero_()
        emb, head = model.get_input_embeddings().weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        emb[:, 0] = 1.0  # every other token -> "x"
        for token, dim, after in ((x, 1, eos), (eos, 2, y), (y, 3, y)):
            emb[token] = 0.0
            emb[token, dim] = 1.0
            head[after, dim] = 1.0
        head[x, 0] = 1.0
    out = root / "end-after-x"
    model.save_pretrained(out)
    served.tokenizer.save_pretrained(out)
    return out


def test_ignore_eos_runs_every_reply_to_max_tokens(tmp_path: Path) -> None:
    """`--ignore-eos` goes with every request: the model ends each reply at its second token
    (the end token) without it, and with it every reply has --max-tokens tokens."""
    model = end_after_x(tmp_path)
    srv = Server(tmp_path / "l3", "--model", str(model), "--l1-bytes", "32MiB").start()
    try:
        replies = {}
        for flag in ([], ["--ignore-eos"]):
            out = tmp_path / f"r{len(flag)}.json"
            cmd = [sys.executable, "-m", "ops.cli", "loadgen", "--url", srv.url, *flag]
            cmd += ["--sessions", "2", "--turns", "2", "--think-ms", "50", "--max-tokens", "8"]
            cmd += ["--system-chars", "200", "--compare", "0", "--out", str(out)]
            cmd += ["--png", str(tmp_path / f"r{len(flag)}.png")]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stdout + done.stderr
            result = json.loads(out.read_text())
            assert result["ok"] == 4 and result["config"]["ignore_eos"] == bool(flag), result
            replies[bool(flag)] = {s["completion_tokens"] for s in result["samples"]}
        assert replies == {False: {2}, True: {8}}
    finally:
        assert srv.stop() == 0, srv.output()


@pytest.mark.parametrize("bad", [["--sessions", "0"], ["--turns", "0"]])
def test_bad_arguments(bad: list[str]) -> None:
    cmd = [sys.executable, "-m", "ops.cli", "loadgen", *bad]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "at least 1" in done.stderr
