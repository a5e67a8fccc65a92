"""What one grammar-constrained row costs the batch's step (structured output, xgrammar).

The server's BatchScheduler (its step captured as CUDA graphs on a GPU, as `kvtier serve`'s
warm-up does) decodes B unconstrained sessions (greedy), and then the same B
with one more session whose reply is constrained to JSON (`response_format` json_object,
sampled). The table: the decode step's P50 and the unconstrained rows' tok/s, each run against
the run without the constrained row (the ceiling, measured in the same process), and their
ratio. A constrained row costs the step its host-side mask (one bitmask row filled, one masked
copy of the rows due) and the greedy lookahead (the step's tokens are read on the host).

    python3 bench/grammar_step.py --shape qwen2-7b --batch 64            # a GPU
    python3 bench/grammar_step.py --shape qwen2-tiny --device cpu --batch 8 --tokens 24
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import build

from kvtier.server.backend import RecomputeBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.batch.jobs import Delta, Finished, Job, Stream
from kvtier.server.config import ServerConfig
from kvtier.server.decoding.grammar import GrammarBook, GrammarSpec
from kvtier.server.devices.model import _wrap, byte_tokenizer


class Steps:
    """The scheduler's metrics hook: every step's (sequences, seconds)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []

    def step(self, n: int, seconds: float) -> None:
        self.steps.append((n, seconds))

    def count(self, name: str, n: int = 1) -> None:
        pass

    def ttft(self, source: str, seconds: float) -> None:
        pass


async def _turn(sched: BatchScheduler, job: Job) -> tuple[str, float, float]:
    stream = Stream(asyncio.get_running_loop())
    t0 = time.perf_counter()
    done = asyncio.wrap_future(sched.submit(job, stream, t0))
    text, first = "", 0.0
    async for e in stream.events():
        if isinstance(e, Delta):
            first = first or time.perf_counter()
            text += e.text
        elif isinstance(e, Finished):
            pass
    await done
    return text, first, time.perf_counter()


def run(
    args: argparse.Namespace, served: Any, book: GrammarBook, constrained: bool
) -> dict[str, Any]:
    steps = Steps()
    cuda = served.device.type == "cuda"
    if cuda:  # kvtier's own device bytes are what the run adds to the weights
        gc.collect()  # the run before's pool and graphs go first
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    cfg = ServerConfig(chunk_tokens=256).as_dict()
    cfg.update(
        max_concurrency=args.batch + 1, batch_kv_bytes=int(args.pool_gib * 2**30), l3_root=""
    )
    sched = BatchScheduler(served, RecomputeBackend(served.model), SimpleNamespace(**cfg), steps)
    sched.capture_graphs()  # as `kvtier serve`'s warm-up: on a GPU the step replays graphs
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(32, 127, (args.prompt,), generator=g).tolist() for _ in range(args.batch)
    ]
    jobs = [
        Job(f"s{i}", "t", tuple(p), args.tokens, temperature=0.0) for i, p in enumerate(prompts)
    ]
    extra = []
    if constrained:
        compiled = book.compile(GrammarSpec("json"))
        extra.append(
            Job(
                "json",
                "t",
                tuple(prompts[0]),
                args.tokens,
                temperature=1.0,
                seed=3,
                grammar=lambda: book.matcher(compiled),
            )
        )

    held = [0]  # the device bytes once every turn is done, the pool still allocated

    async def main() -> list[tuple[str, float, float]]:
        out = list(await asyncio.gather(*(_turn(sched, j) for j in jobs + extra)))
        held[0] = torch.cuda.memory_allocated() if cuda else 0
        return out

    try:
        t0 = time.perf_counter()
        out = asyncio.run(main())
    finally:
        sched.close()
    plain = out[: args.batch]
    full = [s for n, s in steps.steps if n >= args.batch]
    decode = sorted(full[len(full) // 5 :])  # past the prompts' steps
    wall = time.perf_counter() - t0
    print(
        f"  {'with' if constrained else 'without'}: {len(steps.steps)} steps, "
        f"{sum(x for _, x in steps.steps):.2f} s in steps, {wall:.2f} s wall, "
        f"mean batch {statistics.mean(n for n, _ in steps.steps):.1f}"
    )
    if cuda:
        steady = (held[0] - weights) / 2**30
        peak = (torch.cuda.max_memory_allocated() - weights) / 2**30
        print(
            f"    device beyond the weights: steady {steady:.2f} GiB, peak {peak:.2f} GiB "
            f"(page pool budget {args.pool_gib:g} GiB)"
        )
    print(
        "    restores: none (no cache: every turn is a new session's first; nothing leaves "
        "the GPU, and none is meant to: this bench measures the step)"
    )
    return {
        "step_p50_ms": statistics.median(decode) * 1e3 if decode else float("nan"),
        # the unconstrained sessions' tokens over the run (each has exactly args.tokens)
        "toks": args.batch * args.tokens / (max(last for _, _, last in plain) - t0),
        "json": out[-1][0] if constrained else None,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="qwen2-7b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument(
        "--pool-gib", type=float, default=None, help="page pool (default 16 on CUDA, 1 on the CPU)"
    )
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    if args.pool_gib is None:
        args.pool_gib = 16.0 if args.device.startswith("cuda") else 1.0
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = build(args.shape, args.device, dtype).eval()
    served = _wrap(model, byte_tokenizer(), name=f"random-{args.shape}")
    book = GrammarBook(served.tokenizer, model.config.vocab_size, served.eos_ids)
    # replies of fixed length: a random model's greedy replies end early, each at its own step
    # (the grammar still ends its JSON with the end token, which then no longer ends the reply)
    served = dataclasses.replace(served, eos_ids=frozenset())
    run(args, served, book, False)  # warm-up: graphs, allocator
    rows = {"without": [], "with one constrained row": []}
    for _ in range(args.repeats):
        rows["without"].append(run(args, served, book, False))
        rows["with one constrained row"].append(run(args, served, book, True))
    base = statistics.median(r["step_p50_ms"] for r in rows["without"])
    base_t = statistics.median(r["toks"] for r in rows["without"])
    print(
        f"\n{args.shape} on {args.device}, {args.batch} sessions x {args.tokens} tokens, "
        f"{args.prompt}-token prompts, vocab {model.config.vocab_size}"
    )
    print(
        f"{'run':<26} {'step P50 ms':>12} {'ceiling ms':>11} {'ratio':>6} "
        f"{'tok/s':>8} {'ceiling':>8} {'ratio':>6}"
    )
    for name, rs in rows.items():
        step = statistics.median(r["step_p50_ms"] for r in rs)
        toks = statistics.median(r["toks"] for r in rs)
        print(
            f"{name:<26} {step:>12.2f} {base:>11.2f} {base / step:>6.2f} "
            f"{toks:>8.0f} {base_t:>8.0f} {toks / base_t:>6.2f}"
        )
    sample = rows["with one constrained row"][-1]["json"]
    print(f"the constrained reply ({len(sample)} chars): {sample[:120]!r}")


if __name__ == "__main__":
    main()
