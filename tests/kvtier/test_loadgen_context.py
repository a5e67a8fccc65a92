"""kvtier loadgen at the server's context limit: agents start over instead of being refused,
a refusal is reported by its error code, and the server counts each 400 by reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
from server_proc import ROOT, Server

from kvtier.loadgen import refusal


def test_refusal_names_the_error_code() -> None:
    body = {"error": {"message": "too long", "type": "invalid_request_error", "code": "x_y"}}
    assert refusal(400, json.dumps(body).encode()) == "http 400 x_y: too long"
    body["error"]["code"] = None
    assert refusal(400, json.dumps(body).encode()).startswith("http 400 invalid_request_error:")
    assert refusal(502, b"<html>bad gateway</html>") == "http 502: <html>bad gateway</html>"


def loadgen(url: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ops.cli", "loadgen", "--url", url, "--sessions", "2"]
    cmd += ["--think-ms", "20", "--max-tokens", "8", "--compare", "0", "--out", str(out), *args]
    cwd = out.parent / "cwd"  # where a plot written to the current directory would land
    cwd.mkdir(exist_ok=True)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_agents_start_over_at_the_context_limit(tmp_path: Path) -> None:
    srv = Server(tmp_path / "l3", "--max-model-len", "512", "--log-level", "debug").start()
    try:
        # Each turn adds about 100 + 150 characters (tokens, for the built-in byte-level
        # tokenizer) and a reply: the conversation outgrows 512 tokens by the third turn.
        out = tmp_path / "run" / "r.json"
        out.parent.mkdir()
        done = loadgen(
            srv.url,
            out,
            "--turns",
            "6",
            "--system-chars",
            "100",
            "--user-chars",
            "100",
            "--tool-chars",
            "150",
        )
        assert done.returncode == 0, done.stdout + done.stderr
        result = json.loads(out.read_text())
        assert result["errors"] == {}, result["errors"]
        assert result["ok"] == result["requests"] == 12
        context = result["context"]
        assert context["max_model_len"] == 512
        assert context["restarts"] >= 2 and context["sessions_restarted"] == 2, context
        assert "started over at the servers' max_model_len of 512 tokens" in done.stdout
        restarted = [s for s in result["samples"] if s["restarted"]]
        assert len(restarted) == context["restarts"]
        assert all(s["prompt_tokens"] < 512 for s in result["samples"])
        # the plot lands beside --out, not in the current directory
        assert (out.parent / "r.png").read_bytes()[:4] == b"\x89PNG"
        assert list((out.parent / "cwd").iterdir()) == []

        # A system prompt longer than the context: each agent's first turn is refused, by name.
        long = tmp_path / "long.json"
        done = loadgen(srv.url, long, "--turns", "3", "--system-chars", "700")
        assert done.returncode == 1, done.stdout + done.stderr
        assert json.loads(long.read_text())["errors"] == {"http 400 context_length_exceeded": 2}
        assert "2 http 400 context_length_exceeded" in done.stdout
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'kvtier_server_bad_requests_total{reason="context_length_exceeded"} 2.0' in metrics
        bad = httpx.post(srv.url + "/v1/chat/completions", json={"model": "default", "bogus": 1})
        assert bad.status_code == 400
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'kvtier_server_bad_requests_total{reason="invalid_request"} 1.0' in metrics
    finally:
        assert srv.stop() == 0
    log = srv.output()
    assert log.count("400 context_length_exceeded on POST /v1/chat/completions:") == 2, log[-3000:]
    assert "400 invalid_request on POST /v1/chat/completions: unknown field 'bogus'" in log
