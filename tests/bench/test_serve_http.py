"""bench/serve_http.py (the server over HTTP, like for like with the in-process bench): its
steady-state window on replies whose times are known, its table, and the CPU smoke run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from serve_http import MemorySampler, report, steady_state  # noqa: E402

Q = [0.25, 0.25, 0.25]  # four pieces a quarter of a second apart (exact in binary)


def reply(session: int, turn: int, start: float, ttft: float, tokens: int = 4, prompt: int = 0):
    return {
        "session": session,
        "turn": turn,
        "start": start,
        "ttft": ttft,
        "itl": Q,
        "completion_tokens": tokens,
        "prompt_tokens": prompt,
        "cached_tokens": 0,
        "error": None,
        "source": "l1" if turn else "recompute",
    }


def test_steady_state_counts_the_window_between_the_first_turns_and_the_first_leaver() -> None:
    samples = [
        reply(0, 0, 0.0, 1.0),  # pieces 1.0 .. 1.75
        reply(1, 0, 0.0, 3.0),  # 3.0 .. 3.75: the last first turn, the window opens
        reply(0, 1, 2.0, 0.5),  # 2.5 .. 3.25: before it
        reply(1, 1, 4.0, 0.25, prompt=200),  # 4.25 .. 5.0: all in
        # 4.5 .. 5.25, session 0's last: the window closes. Eight tokens in four pieces (end
        # tokens drawn under ignore_eos stream nothing): all eight count
        reply(0, 2, 4.0, 0.5, tokens=8, prompt=100),
        reply(1, 2, 5.0, 0.25, prompt=300),  # 5.25 .. 6.0: one piece of four inside
        {**reply(1, 3, 6.5, 0.0), "ttft": None, "itl": [], "error": "http 500: boom"},
    ]
    got = steady_state(samples, sessions=2)
    assert (got["opens"], got["closes"]) == (3.75, 5.25)
    assert got["tokens"] == 4 + 8 + 1
    assert got["tok_s"] == pytest.approx(13 / 1.5)
    assert got["prompt_tokens_p50"] == 200


def test_no_steady_window_says_why() -> None:
    short = [reply(0, 0, 0.0, 1.0), reply(1, 0, 0.0, 3.0), reply(1, 1, 4.0, 0.25)]
    got = steady_state(short, sessions=2)  # session 0 left at 1.75 s, before 3.75 s
    assert got["tok_s"] is None and "raise --turns or --duration" in got["reason"], got
    got = steady_state(short, sessions=3)
    assert got["tok_s"] is None and "1 of 3 sessions had no reply" in got["reason"], got


def test_the_table_shows_both_figures_against_the_ceiling(capsys: pytest.CaptureFixture) -> None:
    samples = [reply(0, 0, 0.0, 1.0), reply(0, 1, 2.0, 0.5, prompt=300)]
    samples[1]["cached_tokens"] = 280
    result: dict[str, Any] = {
        "throughput": {"completion_tokens_per_s": 50.0},
        "ttft_ms": {"overall": {"p50": 10.0, "p99": 20.0}},
        "samples": samples,
        "errors": {},
    }
    steady = {"tok_s": 90.0, "tokens": 180.0, "opens": 1.75, "closes": 3.75}
    steady["prompt_tokens_p50"] = 300
    args = argparse.Namespace(
        sessions=1, shape="qwen2-tiny", gpu_memory_gb=24.0, eos=False, max_tokens=64, burst=2.0
    )
    args.ramp = None
    args.in_process_toks = 100.0
    mem = MemorySampler("http://127.0.0.1:1")  # never started: its figures set by hand
    mem.used, mem.budget = [1.0 * 2**30, 3.0 * 2**30, 2.0 * 2**30], 4.0 * 2**30
    report(args, result, steady, mem, [], 1.0)
    out = capsys.readouterr().out
    assert "replies of 64 tokens each (ignore_eos" in out
    rows = {ln[:34].strip(): ln[34:].split() for ln in out.splitlines()}
    assert rows["completion tok/s, whole run"] == ["50.0", "100.0", "0.50"]
    assert rows["completion tok/s, steady"] == ["90.0", "100.0", "0.90"]
    assert rows["GPU bytes used, median (GiB)"] == ["2.00", "4.00", "0.50"]
    assert "steady: 180 tokens from 1.8 s" in out and "to 3.8 s" in out
    assert "returning turns: 1, P50 20 prompt tokens each not from the cache" in out
    assert "first turns arrived within 2 s (burst); failed turns 0, dropped connections 0" in out


@pytest.mark.slow
def test_cpu_smoke_run(tmp_path: Path) -> None:
    """The docstring's smoke run: a tiny model on the CPU, 4 sessions for 10 s (about 25 s;
    the first turns take about 5 s of it on 2 cores)."""
    cmd = [sys.executable, str(ROOT / "bench" / "serve_http.py"), "--shape", "qwen2-tiny"]
    cmd += ["--device", "cpu", "--sessions", "4", "--duration", "10", "--out", str(tmp_path)]
    cmd += ["--in-process-toks", "1000"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {ln[:34].strip(): ln[34:].split() for ln in done.stdout.splitlines()}
    whole, steady = rows["completion tok/s, whole run"], rows["completion tok/s, steady"]
    assert float(whole[0]) > 0 and float(whole[2]) == pytest.approx(
        float(whole[0]) / 1000, abs=0.006
    )
    assert float(steady[0]) > 0, done.stdout
    assert "every session's first turn done" in done.stdout
    doc = json.loads((tmp_path / "serve_http.json").read_text())
    assert doc["result"]["config"]["ignore_eos"] is True
    ok = [s for s in doc["result"]["samples"] if s["error"] is None]
    assert ok and {s["completion_tokens"] for s in ok} == {64}
    assert doc["steady"]["tok_s"] == pytest.approx(float(steady[0]), abs=0.1)
    assert doc["steady"]["opens"] < doc["steady"]["closes"]
