"""A real trace through the tiers on a GPU: `kvtier replay` of a sampled slice against
`python -m kvtier.server` with a 7B dummy model, in three configurations at two sizes.

Configurations: kvtier (its tiers: the pool, 64 GiB of L2, L3); GPU-only prefix caching
(`--cache pool`: the page pool alone, as vLLM's automatic prefix caching keeps K/V; a session
resumes from its parked pages while the pool holds them and recomputes after; nothing goes to
L2 or L3); no cache (`--cache none`, every prompt recomputed). Sizes: `--gpu-memory-utilization`
for a 24 GiB GPU, and the whole card. nvidia-smi's used memory is sampled during each run; its
peak is set against the budget. `--prefetch-ahead S` has kvtier's row prefetch each returning
session S seconds before its turn (`kvtier replay --prefetch-ahead`). Each run's replay result goes to `OUT/SIZE-CONFIG/replay.json`
with its plot (TTFT and hit ratio over time) beside it, `replay.png`.

    python3 bench/trace_gpu.py --trace TRACE [--sample 0.03 --speed 10 --duration 60]
    python3 bench/trace_gpu.py --trace SMALL --device cpu --shape qwen2-tiny --sizes whole  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from serve_http import start, utilization_for, write_model  # noqa: E402

from kvtier.replay import ReplayConfig, run  # noqa: E402
from kvtier.replay_report import plot_replay  # noqa: E402

CONFIGS = {
    "kvtier": [],  # with --l2-bytes
    "gpu-only": ["--cache", "pool"],
    "no-cache": ["--cache", "none"],
}


class SmiSampler:
    """nvidia-smi's used memory of one GPU, every half second, in GiB."""

    def __init__(self, index: int) -> None:
        self.index, self.used = index, [0.0]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self.stop.wait(0.5):
            try:
                out = subprocess.run([*cmd, "-i", str(self.index)], capture_output=True, text=True)
                self.used.append(float(out.stdout.strip().splitlines()[0]) / 1024)
            except (OSError, ValueError, IndexError):
                continue


def one(args: argparse.Namespace, model: Path, size: str, name: str, work: Path) -> dict[str, Any]:
    import torch

    cuda = args.device.startswith("cuda")  # else the CPU smoke run: no budget, no nvidia-smi
    total = torch.cuda.get_device_properties(args.device).total_memory / 2**30 if cuda else 0.0
    args.utilization = (
        (utilization_for(24, args.device) if size == "24GiB" else 0.9) if cuda else None
    )
    l2 = ["--l2-bytes", args.l2_bytes] if name == "kvtier" else []
    args.serve_arg = [*CONFIGS[name], *l2, "--max-concurrency", "32"]
    work.mkdir(parents=True, exist_ok=True)
    smi = SmiSampler(torch.device(args.device).index or 0)
    if cuda:
        smi.thread.start()
    proc, url, _log = start(args, model, work)
    try:
        cfg = ReplayConfig(
            trace=args.trace, url=url, speed=args.speed, sample=args.sample, seed=args.seed,
            duration=args.duration, max_output=args.max_output, timeout=args.turn_timeout,
            prefetch_ahead=args.prefetch_ahead if name == "kvtier" else 0.0,
        )  # fmt: skip
        result = run(cfg)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        smi.stop.set()
    l3 = work / "l3"  # the pool alone and no cache write none of it; the tiers' goes
    l3_files = sum(1 for f in l3.rglob("*") if f.is_file()) if l3.exists() else 0
    shutil.rmtree(l3, ignore_errors=True)
    (work / "replay.json").write_text(json.dumps(result, indent=1))
    plot_replay(result, work / "replay.png")
    r = result["replay"]
    return {
        "config": name,
        "size": size,
        "card": torch.cuda.get_device_name(args.device) if cuda else "cpu",
        "budget_gib": args.utilization * total if cuda else None,
        "peak_gib": max(smi.used),
        "l3_files": l3_files,
        **{k: r[k] for k in ("turns", "hit_ratio", "ttft_ms", "tpot_ms", "e2e_ms")},
        **{k: r[k] for k in ("tokens_per_s", "restore_mix", "failed_turns", "cut_prompts")},
        "prefetch": r["prefetch"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'size':<8}{'config':<10}{'turns':>6}{'ideal':>7}{'hit':>7}{'of ideal':>9}"
    head += (
        f"{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>9}{'tok/s':>8}{'fail':>5}{'peak/budget GiB':>17}"
    )
    out = [f"card: {rows[0]['card']}" if rows else "no run", head]
    for r in rows:
        h = r["hit_ratio"]
        out.append(
            f"{r['size']:<8}{r['config']:<10}{r['turns']:>6}{h['ideal']:>7.1%}{h['achieved']:>7.1%}"
            f"{(h['of_ideal'] or 0):>9.2f}{(r['ttft_ms']['p50'] or 0) / 1000:>9.2f}s"
            f"{(r['ttft_ms']['p99'] or 0) / 1000:>8.2f}s{(r['tpot_ms']['p50'] or 0):>7.1f}ms"
            f"{r['tokens_per_s']:>8.0f}{r['failed_turns']:>5}"
            f"{r['peak_gib']:>9.1f}/{r['budget_gib'] or 0:.1f}"
        )
    return "\n".join(out)


def targets(rows: list[dict[str, Any]]) -> list[str]:
    by = {(r["size"], r["config"]): r for r in rows}
    out = []
    for size in ("24GiB", "whole"):
        k, g = by.get((size, "kvtier")), by.get((size, "gpu-only"))
        if k:
            ok = (k["hit_ratio"]["of_ideal"] or 0) >= 0.95
            out.append(f"{size}: kvtier hit ratio >= 0.95 of ideal: {'PASS' if ok else 'FAIL'}")
        if k and g:
            ok = k["tokens_per_s"] >= g["tokens_per_s"]
            out.append(f"{size}: kvtier tok/s >= GPU-only's: {'PASS' if ok else 'FAIL'}")
            if size == "24GiB":
                ratio = (g["ttft_ms"]["p50"] or 0) / max(1e-9, k["ttft_ms"]["p50"] or 0)
                verdict = "PASS" if ratio >= 3 else "FAIL"
                out.append(f"24GiB: TTFT p50 GPU-only / kvtier = {ratio:.2f} (>= 3): {verdict}")
    for r in rows:  # the baselines are what they say: nothing below the pool, or nothing at all
        mix = r["restore_mix"]
        below = r["l3_files"] + sum(n for src, n in mix.items() if src not in ("l1", "recompute"))
        if r["config"] == "gpu-only":
            verdict = "PASS" if below == 0 else "FAIL"
            out.append(f"{r['size']} gpu-only: no restore or file below the pool: {verdict}")
        elif r["config"] == "no-cache":
            ok = r["hit_ratio"]["achieved"] == 0 and set(mix) <= {"recompute"}
            out.append(f"{r['size']} no-cache: every prompt recomputed: {'PASS' if ok else 'FAIL'}")
    for r in rows:
        budget = r["budget_gib"]  # None on the CPU: no device budget
        ok = r["failed_turns"] == 0 and (budget is None or r["peak_gib"] <= budget)
        out.append(
            f"{r['size']} {r['config']}: 0 failed, peak inside budget: {'PASS' if ok else 'FAIL'}"
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="the trace (Mooncake's JSONL)")
    p.add_argument("--sample", type=float, default=0.03, help="fraction of conversations")
    p.add_argument("--speed", type=float, default=10.0, help="time scaling of the trace")
    p.add_argument("--duration", type=float, default=50.0, help="seconds of replay a run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-output", type=int, default=256, help="reply tokens at most")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--turn-timeout", type=float, default=120.0)
    p.add_argument("--l2-bytes", default="64GiB", help="kvtier's row: L2 (host memory)")
    p.add_argument(
        "--prefetch-ahead",
        type=float,
        default=0.0,
        help="kvtier's row: prefetch a returning session this many seconds before its turn",
    )
    p.add_argument("--shape", default="qwen2-7b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--sizes", default="24GiB,whole")
    p.add_argument("--configs", default=",".join(CONFIGS))
    args = p.parse_args()
    out = Path(os.environ.get("OUT") or "trace-gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    model = write_model(out, args.shape, args.max_model_len)
    rows = []
    for size in args.sizes.split(","):
        for name in args.configs.split(","):
            t0 = time.monotonic()
            rows.append(one(args, model, size, name, out / f"{size}-{name}"))
            print(f"== {size} {name}: {time.monotonic() - t0:.0f} s", flush=True)
            (out / "trace_gpu.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print("\n".join(targets(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
