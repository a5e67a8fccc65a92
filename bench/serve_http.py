"""The product path: `kvtier serve --load-format dummy` at a model's full scale, driven over HTTP.

It writes a model directory holding only a `config.json` (a Qwen2-7B shape by default, with the
built-in byte tokenizer's 257-token vocabulary), starts `python -m kvtier.server` on it with
`--load-format dummy` and the GPU memory budget alone (`--gpu-memory-utilization`; every other
setting at its default), and runs `kvtier loadgen`'s agent fleet against it: N sessions sharing a
system prompt, growing by a user message and a tool result a turn, with think time.

Like for like with the in-process bench (`bench/agent_fleet.py --concurrent`), which decodes
exactly `--decode-tokens` (64) tokens a turn and opens its window once its sessions are seeded:

- every reply runs to `--max-tokens` (64): the requests carry `ignore_eos`, so the end token,
  which random weights draw early and at random, ends none (`--eos` lets it end them again);
- beside the figure over the whole run, a steady-state figure counts only the tokens that
  arrive after every session's first turn (its whole-prompt prefill, about 3,000 tokens, all
  sessions' at once at the start) has ended, and before the first session has run out of turns
  (or hit `--duration`): all N sessions are in the fleet for all of the window. A reply that
  straddles an edge counts pro rata by its streamed pieces (a piece a token, but for an end
  token drawn under `ignore_eos`, which streams no text). The window is printed; none opens
  when a session is done before the last first turn ends: raise `--turns` or `--duration`.

While the fleet runs, /metrics is scraped every second: the process's GPU bytes
(`kvtier_gpu_memory_process_bytes`) against the plan's budget. The server's log gives the plan and
the start-up phases' peaks. The table: completion tokens/s, over the whole run and steady, against
the in-process bench's figure for the same GPU (`--in-process-toks`, from bench/small_gpu.py or
bench/agent_fleet.py in the same run), TTFT P50/P99, where returning turns were restored from
and how much of their prompts the cache held, and the GPU bytes.

A burst (`--burst 2`): every session's first turn, a prompt of about 3,000 tokens, arrives
within 2 s, as agents do after a deploy or a restart; `--ramp S` spreads the first turns over S
seconds instead (the staggered baseline). Beside /metrics, `nvidia-smi` is sampled every half
second: the device's used memory, the CUDA context and every non-PyTorch byte included, whose
peak must stay within the budget. Failed turns and dropped connections are counted apart.

    python3 bench/serve_http.py --gpu-memory-gb 24 --sessions 64 --duration 60
    python3 bench/serve_http.py --burst 2 --sessions 64 --duration 60   # the deploy burst
    python3 bench/serve_http.py --shape qwen2-tiny --device cpu --sessions 4 --duration 10  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from models import SHAPES  # noqa: E402

from kvtier.loadgen import LoadConfig, run  # noqa: E402

BYTE_VOCAB = 257  # the built-in byte tokenizer: 256 bytes and the end token (id 256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_model(root: Path, shape: str, context: int) -> Path:
    """A model directory with a config.json alone: `shape`'s layers, the byte vocabulary."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        max_position_embeddings=context,
        bos_token_id=None,
        eos_token_id=BYTE_VOCAB - 1,
        pad_token_id=BYTE_VOCAB - 1,
        tie_word_embeddings=False,
        **{**SHAPES[shape], "vocab_size": BYTE_VOCAB},
    )
    cfg.dtype = "bfloat16"
    out = root / f"dummy-{shape}"
    cfg.save_pretrained(out)
    return out


def utilization_for(gb: float, device: str) -> float:
    """The fraction of the device that `gb` GiB is: the budget flag that makes it that GPU."""
    import torch

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return min(1.0, gb * 2**30 / total)


def start(args: argparse.Namespace, model: Path, work: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = work / "serve.log"
    cmd = [sys.executable, "-m", "kvtier.server", "--port", str(port)]
    cmd += ["--model", str(model), "--load-format", "dummy", "--l3-root", str(work / "l3")]
    cmd += ["--device", args.device]
    if args.utilization is not None:
        cmd += ["--gpu-memory-utilization", f"{args.utilization:.4f}"]
    cmd += ["--max-model-len", str(args.max_model_len)]
    cmd += list(args.serve_arg)
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    env = {k: v for k, v in env.items() if not k.startswith("KVTIER_")}
    print("server:", " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:]
            raise SystemExit(f"server exited {proc.returncode}; the end of its log:\n{tail}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server not ready in {args.start_timeout:.0f} s; see {log}")


_GAUGE = re.compile(r"^(kvtier_gpu_memory_(?:process|budget)_bytes)(?:\{[^}]*\})? ([0-9.eE+-]+)$")


class SmiSampler:
    """`nvidia-smi`'s used memory of one GPU every `every` s (MiB -> bytes): what torch's
    counters miss too (the CUDA context, cuBLAS workspaces, NCCL, other libraries)."""

    def __init__(self, index: int = 0, every: float = 0.5) -> None:
        self.index, self.every = index, every
        self.idle: float | None = None  # before the fleet: the weights, graphs, the context
        self.used: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> float | None:
        try:
            out = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=memory.used",
                    "--format=csv,noheader,nounits",
                    "-i",
                    str(self.index),
                ],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            return float(out.splitlines()[0]) * 2**20
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            v = self.read()
            if v is not None:
                self.used.append(v)

    def __enter__(self) -> SmiSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def failures(result: dict[str, Any]) -> tuple[int, int]:
    """(failed turns, of them dropped connections): a turn whose request ended in an error,
    and among those the ones whose connection closed without an HTTP answer."""
    failed = dropped = 0
    for sample in result["samples"]:
        err = sample.get("error")
        if err:
            failed += 1
            if any(k in err for k in ("ReadError", "RemoteProtocolError", "ConnectError")):
                dropped += 1
    return failed, dropped


class MemorySampler:
    """Scrapes /metrics every `every` s: the GPU bytes used, their peak, and the budget."""

    def __init__(self, url: str, every: float = 1.0) -> None:
        self.url, self.every = url, every
        self.used: list[float] = []
        self.budget = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                text = httpx.get(self.url + "/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            for line in text.splitlines():
                m = _GAUGE.match(line)
                if m and m.group(1).endswith("process_bytes"):
                    self.used.append(float(m.group(2)))
                elif m:
                    self.budget = float(m.group(2))

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def piece_times(sample: dict[str, Any]) -> list[float]:
    """When each streamed piece of a reply arrived, in seconds since the run started."""
    t = sample["start"] + sample["ttft"]
    times = [t]
    for gap in sample["itl"]:
        t += gap
        times.append(t)
    return times


def steady_state(samples: list[dict[str, Any]], sessions: int) -> dict[str, Any]:
    """Completion tokens per second while all `sessions` were in the fleet with their first
    turns behind them: from the end of the last session's first reply (the first turns'
    whole-prompt prefills all fall before it) to the end of the first session's last reply.

    A reply's tokens count where its pieces arrived; one that straddles an edge counts pro rata
    by its pieces (exact when each token streams a piece; an end token drawn under ignore_eos
    streams none). `tok_s` is None, with the `reason`, when there is no such window."""
    runs: dict[int, list[list[float]]] = {}
    replies: list[tuple[list[float], int, int]] = []
    for sm in samples:
        if sm["error"] is None and sm["ttft"] is not None:
            times = piece_times(sm)
            runs.setdefault(sm["session"], []).append(times)
            replies.append((times, sm["completion_tokens"], sm["prompt_tokens"]))
    out: dict[str, Any] = {"tok_s": None, "opens": None, "closes": None, "tokens": 0.0}
    if len(runs) < sessions:
        out["reason"] = f"{sessions - len(runs)} of {sessions} sessions had no reply"
        return out
    # a session's replies come one after another: its first ends first, its last ends last
    opens = max(min(r[-1] for r in rs) for rs in runs.values())
    closes = min(max(r[-1] for r in rs) for rs in runs.values())
    out.update(opens=opens, closes=closes)
    if closes <= opens:
        out["reason"] = (
            f"a session's last turn (its --turns or --duration used up) ended at {closes:.1f} s, "
            f"before the last first turn did, at {opens:.1f} s; raise --turns or --duration"
        )
        return out
    prompts = []
    for times, tokens, prompt in replies:
        inside = sum(1 for t in times if opens < t <= closes)
        if inside:
            out["tokens"] += tokens * inside / len(times)
            prompts.append(prompt)
    out["tok_s"] = out["tokens"] / (closes - opens)
    out["prompt_tokens_p50"] = sorted(prompts)[len(prompts) // 2] if prompts else None
    return out


def plan_lines(log: Path) -> list[str]:
    """The server log's memory plan lines (at start, and with the measured figures)."""
    keep = ("GPU memory plan", "captured as CUDA graphs", "warm-up", "ready:")
    return [ln for ln in log.read_text(errors="replace").splitlines() if any(k in ln for k in keep)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="qwen2-7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="run as a GPU of this size")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--think-ms", type=float, default=100.0)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="tokens a reply (the in-process bench's --decode-tokens: 64)",
    )
    p.add_argument(
        "--eos",
        action="store_true",
        help="let the end token end a reply (default: ignore_eos, every reply --max-tokens long)",
    )
    p.add_argument("--system-chars", type=int, default=2600)
    p.add_argument("--user-chars", type=int, default=120)
    p.add_argument("--tool-chars", type=int, default=120)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument(
        "--burst",
        type=float,
        default=None,
        metavar="S",
        help="every session's first turn arrives within S seconds (e.g. 2: a deploy's burst)",
    )
    p.add_argument(
        "--ramp",
        type=float,
        default=None,
        metavar="S",
        help="spread the first turns over S seconds (default: the think time)",
    )
    p.add_argument("--in-process-toks", type=float, default=None, help="the ceiling's tok/s")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--serve-arg", action="append", default=[], help="one more server flag")
    p.add_argument("--out", type=Path, default=None, help="a directory for the JSON and log")
    args = p.parse_args(argv)
    args.utilization = None
    if args.gpu_memory_gb is not None:
        if not args.device.startswith("cuda"):
            raise SystemExit("--gpu-memory-gb needs a CUDA --device")
        args.utilization = utilization_for(args.gpu_memory_gb, args.device)
    with tempfile.TemporaryDirectory(prefix="kvtier-http-") as tmp:
        work = Path(tmp)
        model = write_model(work, args.shape, 32768)
        t0 = time.perf_counter()
        proc, url, log = start(args, model, work)
        ready_s = time.perf_counter() - t0
        print(f"ready in {ready_s:.1f} s", flush=True)
        try:
            cfg = LoadConfig(
                url=url,
                sessions=args.sessions,
                turns=args.turns,
                think_ms=args.think_ms,
                max_tokens=args.max_tokens,
                system_chars=args.system_chars,
                user_chars=args.user_chars,
                tool_chars=args.tool_chars,
                duration=args.duration,
                compare=0,
                ignore_eos=not args.eos,
                ramp=args.burst if args.burst is not None else args.ramp,
            )
            smi = SmiSampler(int(args.device.partition(":")[2] or 0))
            smi.idle = smi.read() if args.device.startswith("cuda") else None
            with MemorySampler(url) as mem, smi:
                result = run(cfg)
        finally:
            proc.terminate()
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        lines = plan_lines(log)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "serve_http.log").write_text(log.read_text(errors="replace"))
    steady = steady_state(result["samples"], args.sessions)
    report(args, result, steady, mem, lines, ready_s, smi)
    if args.out is not None:
        doc = {"args": {k: str(v) for k, v in vars(args).items()}, "result": result}
        doc["steady"] = steady
        doc["gpu"] = {
            "used_peak": max(mem.used, default=0),
            "used_median": sorted(mem.used)[len(mem.used) // 2] if mem.used else 0,
            "budget": mem.budget,
            "smi_peak": max(smi.used, default=0),
            "smi_idle": smi.idle,
        }
        doc["failed"], doc["dropped"] = failures(result)
        (args.out / "serve_http.json").write_text(json.dumps(doc, indent=1, default=str))
    return 0 if not result["errors"] else 1


def report(
    args: argparse.Namespace,
    result: dict[str, Any],
    steady: dict[str, Any],
    mem: MemorySampler,
    lines: list[str],
    ready: float,
    smi: SmiSampler | None = None,
) -> None:
    for ln in lines:
        print("server:", ln.split(": ", 1)[-1] if "kvtier.server" in ln else ln)
    tp = result["throughput"]["completion_tokens_per_s"]
    ttft = result["ttft_ms"]["overall"]
    sources: dict[str, int] = {}
    returning: list[tuple[int, int]] = []
    for sample in result["samples"]:
        if sample["error"] is None:
            sources[sample["source"]] = sources.get(sample["source"], 0) + 1
            if sample["turn"] > 0:
                returning.append((sample["prompt_tokens"], sample["cached_tokens"]))
    cap = f"{args.gpu_memory_gb:g} GB" if args.gpu_memory_gb else "the whole device"
    print(f"\n{args.sessions} agent sessions over HTTP, {args.shape} with dummy weights, on {cap}")
    if args.eos:
        print(f"replies of at most {args.max_tokens} tokens (--eos: the end token ends some early)")
    else:
        print(f"replies of {args.max_tokens} tokens each (ignore_eos: the end token ends none)")
    print(f"{'figure':34} {'value':>12} {'ceiling':>12} {'ratio':>7}")
    ceiling = args.in_process_toks
    for name, value in (
        ("completion tok/s, whole run", tp),
        ("completion tok/s, steady", steady["tok_s"]),
    ):
        if value is None:
            print(f"{name:34} {'n/a':>12} {ceiling or float('nan'):12.1f} {'n/a':>7}")
            continue
        ratio = f"{value / ceiling:.2f}" if ceiling else "n/a"
        print(f"{name:34} {value:12.1f} {ceiling or float('nan'):12.1f} {ratio:>7}")
    if mem.used and mem.budget:
        peak = max(mem.used)
        median = sorted(mem.used)[len(mem.used) // 2]
        print(
            f"{'GPU bytes used, peak (GiB)':34} {peak / 2**30:12.2f} {mem.budget / 2**30:12.2f} {peak / mem.budget:7.2f}"
        )
        print(
            f"{'GPU bytes used, median (GiB)':34} {median / 2**30:12.2f} {mem.budget / 2**30:12.2f} {median / mem.budget:7.2f}"
        )
    else:
        print("GPU bytes: no plan exported (CPU)")
    if smi is not None and smi.used and mem.budget:
        peak = max(smi.used)
        print(
            f"{'nvidia-smi used, peak (GiB)':34} {peak / 2**30:12.2f} {mem.budget / 2**30:12.2f} {peak / mem.budget:7.2f}"
        )
    failed, dropped = failures(result)
    burst, ramp = args.burst, args.ramp
    arrivals = (
        f"within {burst:g} s (burst)"
        if burst is not None
        else (f"over {ramp:g} s" if ramp is not None else "over the think time")
    )
    print(f"first turns arrived {arrivals}; failed turns {failed}, dropped connections {dropped}")
    print(
        f"TTFT P50 {ttft.get('p50', float('nan')):.1f} ms, P99 {ttft.get('p99', float('nan')):.1f} ms"
    )
    if steady["tok_s"] is not None:
        print(
            f"steady: {steady['tokens']:.0f} tokens from {steady['opens']:.1f} s (every "
            f"session's first turn done) to {steady['closes']:.1f} s (the first session's last "
            f"turn done) of the run, prompts P50 {steady['prompt_tokens_p50']} tokens"
        )
    else:
        print(f"steady: no window: {steady['reason']}")
    print(f"requests by restore source: {json.dumps(sources)}")
    if returning:
        new = sorted(p - c for p, c in returning)[len(returning) // 2]
        print(f"returning turns: {len(returning)}, P50 {new} prompt tokens each not from the cache")
    print(f"errors: {json.dumps(result.get('errors', {}))}; ready after {ready:.1f} s")


if __name__ == "__main__":
    raise SystemExit(main())
