"""kvtier replay and kvtier plan --trace: a trace read strictly, its sessions, samples and ideal;
a small slice replayed through the built-in model on a live server; and the simulator's hit
ratio against the replay's for the same slice and sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_proc import ROOT, Server
from trace_slice import write_trace

from kvtier import trace, tracesim


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ops.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "line 2: not JSON"),
        ('{"timestamp": 5, "input_length": 10, "output_length": 1}', "missing field(s) hash_ids"),
        ('{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [0]}', "needs 2"),
        ('{"timestamp": 5, "input_length": 10, "output_length": -1, "hash_ids": [0]}', "output"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}', "before"),
        ("[1, 2]", "a JSON object is expected"),
    ],
)
def test_a_bad_line_is_a_typed_error_naming_it(tmp_path: Path, line: str, says: str) -> None:
    good = '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [0]}'
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(trace.TraceError, match="line 2") as err:
        trace.load(path)
    assert says in str(err.value)
    done = _cli("replay", str(path), "--url", "http://127.0.0.1:9")  # refused before any request
    assert done.returncode == 2 and "line 2" in done.stderr, done.stderr


def test_sessions_sample_and_ideal(tmp_path: Path) -> None:
    rows = [  # conversation A, conversation B, A continued, B branched by another (C)
        (0, 1100, [0, 1, 2]),
        (10, 700, [0, 3]),
        (20, 2000, [0, 1, 4, 5]),
        (30, 1100, [0, 6, 7]),
    ]
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": 4, "hash_ids": h})
            + "\n"
            for t, n, h in rows
        )
    )
    reqs = trace.load(path)
    assert [r.session for r in reqs] == [1, 2, 1, 4]  # block 0 alone joins nobody
    turns = trace.select(reqs, trace.Slice())
    # line 2 and 4 find block 0 (512), line 3 blocks 0 and 1 (1,024)
    assert [t.ideal_cached for t in turns] == [0, 512, 1024, 512]
    assert trace.ideal_ratio(turns) == pytest.approx(2048 / 4900)
    cut = trace.select(reqs, trace.Slice(max_input=600, speed=2.0))
    assert [t.input_tokens for t in cut] == [600, 600, 600, 600] and cut[2].cut == 1400
    assert [t.at for t in cut] == [0.0, 0.005, 0.01, 0.015]
    assert [t.ideal_cached for t in cut] == [0, 512, 600, 512]
    assert len(trace.select(reqs, trace.Slice(duration=0.015))) == 2
    big = write_trace(tmp_path / "big.jsonl", conversations=40, turns=3)
    everything = trace.load(big)
    half = trace.select(everything, trace.Slice(sample=0.5, seed=3))
    kept = {t.request.session for t in half}
    assert 8 < len(kept) < 32 and kept == {t.request.session for t in trace.select(
        everything, trace.Slice(sample=0.5, seed=3))}  # fmt: skip
    assert all(  # whole conversations: every turn of a kept one
        t.request.session in kept for t in half
    ) and len(half) == sum(1 for r in everything if r.session in kept)
    a, b = trace.Tokens(257, 0), trace.Tokens(257, 1)
    assert a.prompt([5, 6], 700)[:512] == a.prompt([5], 512) and len(a.prompt([5, 6], 700)) == 700
    assert a.prompt([5], 512) != a.prompt([6], 512) and a.prompt([5], 512) != b.prompt([5], 512)
    assert max(a.prompt(list(range(40)), 40 * 512)) < 257


def test_the_simulator_evicts_and_spares_referenced_chunks(tmp_path: Path) -> None:
    turns = trace.select(trace.load(write_trace(tmp_path / "t.jsonl")), trace.Slice())
    bpt, chunk = 512, 256 * 512
    unbounded = tracesim.simulate(turns, tracesim.Sizes(0, 0, None), bpt)
    assert unbounded.ratio(unbounded.hit_tokens) == pytest.approx(trace.ideal_ratio(turns), 0.02)
    nothing = tracesim.simulate(turns, tracesim.Sizes(0, 0, 0), bpt)
    assert nothing.hit_tokens == 0 and nothing.recomputed_tokens == nothing.prompt_tokens
    small = tracesim.simulate(turns, tracesim.Sizes(0, 24 * chunk, 0), bpt)
    assert 0 < small.hit_tokens < unbounded.hit_tokens
    assert small.tiers["l2"].evicted_bytes > 0 and small.tiers["l3"].written_bytes == 0
    # L3 at a slow read against a fast prefill: the cost model recomputes instead
    slow = tracesim.Costs({"l1": 1e12, "l2": 1e12, "l3": 1e3}, 1e-6)
    l3_only = tracesim.simulate(turns, tracesim.Sizes(0, 0, None), bpt, costs=slow)
    assert l3_only.found_tokens > 0 and l3_only.tiers["l3"].hit_tokens == 0


def test_replay_a_slice_through_the_built_in_model_and_the_simulator_agrees(
    tmp_path: Path,
) -> None:
    """The smoke test of `kvtier replay`, and `kvtier plan --trace`'s check: tiers small enough
    that L2 and L3's cap evict (a few MiB of the built-in model's 512 bytes a token), replayed
    for real, then simulated at the same sizes: the hit ratios agree within 5 points."""
    path = write_trace(tmp_path / "t.jsonl")
    sizes = {"--batch-kv-bytes": 6 * 2**20, "--l2-bytes": 4 * 2**20, "--l3-max-bytes": 8 * 2**20}
    args = [str(x) for kv in sizes.items() for x in kv]
    srv = Server(tmp_path / "l3", *args, module="ops.cli serve").start()
    try:
        out, png = tmp_path / "r.json", tmp_path / "r.png"
        done = _cli("replay", str(path), "--url", srv.url, "--out", str(out), "--png", str(png))
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        assert srv.stop() == 0, srv.output()
    result = json.loads(out.read_text())
    r = result["replay"]
    assert r["turns"] == 18 and r["failed_turns"] == 0 and result["ok"] == 18
    assert r["conversations"] == 6 and sum(r["restore_mix"].values()) == 18
    assert all(s["completion_tokens"] == 8 for s in result["samples"])  # the trace's length
    assert all(r[k]["p50"] and r[k]["p99"] >= r[k]["p50"] for k in ("ttft_ms", "tpot_ms", "e2e_ms"))
    assert r["tokens_per_s"] > 0 and r["cut_prompts"] == 0
    turns = trace.select(trace.load(path), trace.Slice())
    assert r["hit_ratio"]["ideal"] == pytest.approx(trace.ideal_ratio(turns))
    assert r["hit_ratio"]["achieved"] > 0.8 * r["hit_ratio"]["ideal"], r["hit_ratio"]
    assert "hit ratio: ideal" in done.stdout and "restore mix" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tiers = result["tiers"]["tiers"]
    assert tiers["l3"]["used_bytes"] <= sizes["--l3-max-bytes"]  # the cap bit
    sim = tracesim.simulate(
        turns,
        tracesim.Sizes(sizes["--batch-kv-bytes"], sizes["--l2-bytes"], sizes["--l3-max-bytes"]),
        bytes_per_token=512,  # the built-in model on the CPU: 2 layers x K,V x 2 heads x 16 x fp32
        costs=tracesim.Costs(cost_model=False),  # on 2 cores, loading always beats prefill
    )
    assert abs(sim.ratio(sim.hit_tokens) - r["hit_ratio"]["achieved"]) <= 0.05


def test_plan_trace_names_the_sizes(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", conversations=30, turns=4)
    out = tmp_path / "plan.json"
    done = _cli(
        "plan", "--model", "configs/models/qwen2-7b", "--trace", str(path),
        "--gpu-mem", "24GiB", "--max-model-len", "8192", "--l2-bytes", "1GiB",
        "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    plan = json.loads(out.read_text())
    assert plan["requests"] == 120 and plan["bytes_per_token"] == 57344
    hits = [row["hit_ratio"] for row in plan["l2_alone"]]
    assert hits == sorted(hits) and hits[-1] == pytest.approx(plan["ideal_hit_ratio"], 0.02)
    assert plan["l2_bytes_for_target"] is not None
    assert "L2 alone:" in done.stdout and "reaches" in done.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1}\n')
    done = _cli(
        "plan", "--model", "configs/models/qwen2-7b", "--max-model-len", "8192", "--trace", str(bad)
    )
    assert done.returncode == 2 and "line 1: missing field(s)" in done.stderr
