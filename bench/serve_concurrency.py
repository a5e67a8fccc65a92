"""Aggregate decode rate of `kvtier serve` with 1 vs N concurrent sessions, batching on vs off.

For each mode (`--batching`, `--no-batching`) it starts `python -m kvtier.server` (the built-in
random model unless --model), then for each session count runs that many clients at once for
`--seconds`: each client sends non-streaming chat requests back to back on its own session
(`--max-tokens` new tokens each, a short prompt that the cache restores after the first turn),
so the server holds that many sessions decoding the whole time. Aggregate decode rate =
completion tokens of every finished request / the time until the last one finished. The table
gives each rate and its ratio to the same mode's one-session rate; the target is N=16 >= 4x
with batching on two CPU cores.

    PYTHONPATH=. python3 bench/serve_concurrency.py [--sessions 1,16] [--device cpu] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: argparse.Namespace, batching: bool, work: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    l3 = work / f"l3-{'on' if batching else 'off'}"
    log = work / f"serve-{'on' if batching else 'off'}.log"
    cmd = [sys.executable, "-m", "kvtier.server", "--port", str(port), "--l3-root", str(l3)]
    cmd += ["--log-level", "warning", "--max-concurrency", str(max(args.sessions))]
    cmd += ["--batching" if batching else "--no-batching", "--device", args.device]
    if args.model:
        cmd += ["--model", args.model]
    if args.park_pages:
        cmd += ["--park-pages"]
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    env = {k: v for k, v in env.items() if not k.startswith("KVTIER_")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"server exited {proc.returncode}; the end of {log}:\n{tail}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"server not ready in 300 s; see {log}")


def _body(sid: str, max_tokens: int, seed: int) -> dict[str, object]:
    text = f"session {sid}: continue the story of the lighthouse keeper. "
    return {
        "model": "default",
        "messages": [{"role": "user", "content": text * 2}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": seed,
    }


async def client(
    http: httpx.AsyncClient, url: str, sid: str, args: argparse.Namespace, end: float
) -> tuple[int, int]:
    """Requests back to back until `end`; (completion tokens, requests)."""
    tokens = requests = 0
    while time.perf_counter() < end:
        r = await http.post(
            url + "/v1/chat/completions",
            json=_body(sid, args.max_tokens, requests),
            headers={"X-Session-ID": sid},
            timeout=600,
        )
        r.raise_for_status()
        tokens += int(r.json()["usage"]["completion_tokens"])
        requests += 1
    return tokens, requests


async def measure(url: str, n: int, args: argparse.Namespace, tag: str) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(limits=limits) as http:
        # One short request per session first: the sessions exist and their prompt is cached.
        warm = [
            http.post(
                url + "/v1/chat/completions",
                json=_body(f"{tag}-{i}", 4, 0),
                headers={"X-Session-ID": f"{tag}-{i}"},
                timeout=600,
            )
            for i in range(n)
        ]
        for r in await asyncio.gather(*warm):
            r.raise_for_status()
        t0 = time.perf_counter()
        done = await asyncio.gather(
            *(client(http, url, f"{tag}-{i}", args, t0 + args.seconds) for i in range(n))
        )
        elapsed = time.perf_counter() - t0
    tokens = sum(t for t, _ in done)
    return tokens / elapsed, sum(r for _, r in done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", default="1,16", help="comma-separated session counts")
    ap.add_argument("--modes", default="on,off", help="batching modes to run: on, off or both")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--park-pages", action="store_true", help="serve with --park-pages (batching on)"
    )
    ap.add_argument("--model", default=None, help="local HF model dir (default: built-in)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured window per point")
    args = ap.parse_args()
    args.sessions = [int(x) for x in args.sessions.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvtier-concurrency-"))
    rows: list[tuple[str, int, float, float, int]] = []
    for mode in modes:
        proc, url = start(args, mode == "on", work)
        try:
            base = None
            for n in args.sessions:
                rate, requests = asyncio.run(measure(url, n, args, f"{mode}{n}"))
                base = rate if base is None else base
                rows.append((mode, n, rate, rate / base, requests))
                print(f"batching {mode:3} sessions {n:3}: {rate:8.1f} tok/s", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    print()
    print(f"device {args.device}, {os.cpu_count()} CPUs, max_tokens {args.max_tokens}")
    print("| batching | sessions | decode tok/s | vs 1 session | requests |")
    print("|---|---:|---:|---:|---:|")
    for mode, n, rate, ratio, requests in rows:
        print(f"| {mode} | {n} | {rate:.1f} | {ratio:.2f}x | {requests} |")


if __name__ == "__main__":
    main()
