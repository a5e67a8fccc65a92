"""One batched step of the paged runner, by kind, against transformers' own batched step.

`PYTHONPATH=. python3 bench/paged_step.py [--batch 64] [--context 3000] [--chunk 512]
[--prefills 2] [--profile]` builds the Qwen2-7B shape with random bf16 weights (CUDA), fills
`--batch` paged sequences with `--context` tokens of random K/V (the values do not change the
timing), and times:

- a decode-only step: eager, and replayed from a CUDA graph;
- a mixed step: the decode rows of `--batch - --prefills` sequences plus `--prefills` prompt
  chunks of `--chunk` tokens appended to `--context`-token contexts: replayed from a CUDA graph,
  and eager on each attention backend that takes it (rows, split, reference);

against the ceilings measured in the same run: transformers' batched decode step over
`DynamicCache` (every context resident, SDPA), and that decode step plus the prompt chunks
prefilled alone (their `DynamicCache` forward). `--profile` prints the top operators of one mixed
step (torch.profiler).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from models import build

from kvtier.geometry import KVGeometry
from kvtier.integrations.hf import cache_kwarg
from kvtier.paged import BatchRunner, PagedSequence, PagePool, SeqInput


def timed(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs (after one warm-up), synchronized."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--prefills", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("paged_step.py measures CUDA steps: no CUDA device here")
    dev = "cuda"
    model = build("qwen2-7b", dev, torch.bfloat16)
    geo = KVGeometry.from_config(model.config, dtype="bfloat16")
    max_ctx = args.context + args.chunk + 64
    budget = (args.batch + args.prefills + 2) * max_ctx * geo.bytes_per_token
    pool = PagePool(geo, budget, page_size=16, device=dev, dtype=torch.bfloat16)
    pool.kv.normal_(0, 0.5)
    seqs = [PagedSequence() for _ in range(args.batch)]
    for s in seqs:
        assert pool.reserve(s, args.context)
        s.length = args.context
    n_dec = args.batch - args.prefills
    rows: list[tuple[str, float, float]] = []  # (figure, seconds, ceiling seconds)

    # the ceilings: transformers' own batched step over DynamicCache, and a prefill alone
    from transformers import DynamicCache

    def dyn_cache(b: int, n: int) -> DynamicCache:
        cache = DynamicCache(config=model.config)
        for layer in range(geo.num_layers):
            k = torch.randn(b, geo.num_kv_heads, n, geo.head_dim, device=dev, dtype=torch.bfloat16)
            cache.update(k, k.clone(), layer)
        return cache

    kw = cache_kwarg(model)
    cache = dyn_cache(args.batch, args.context)
    ids = torch.zeros(args.batch, 1, dtype=torch.long, device=dev)

    def dyn_decode() -> None:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=True, **{kw: cache})
        cache.crop(args.context)

    ceil_decode = timed(dyn_decode, args.reps)
    cache.crop(0)  # frees its tensors
    pcache = dyn_cache(args.prefills, args.context)
    pids = torch.zeros(args.prefills, args.chunk, dtype=torch.long, device=dev)

    def dyn_prefill() -> None:
        with torch.inference_mode():
            model(input_ids=pids, use_cache=True, logits_to_keep=1, **{kw: pcache})
        pcache.crop(args.context)

    ceil_prefill = timed(dyn_prefill, args.reps)
    pcache.crop(0)
    torch.cuda.empty_cache()

    # kvtier's runner (switches the model to paged attention)
    runner = BatchRunner(model, pool, max_batch=args.batch, max_tokens=4096, max_seq_len=8192)

    def decode_step() -> None:
        runner.step([SeqInput(s, [0]) for s in seqs])
        for s in seqs:
            s.length -= 1

    rows.append(("decode-only step, eager (rows)", timed(decode_step, args.reps), ceil_decode))
    mixed_tokens = n_dec + args.prefills * args.chunk
    runner.capture_graphs([args.batch, mixed_tokens])
    rows.append(("decode-only step, CUDA graph", timed(decode_step, args.reps), ceil_decode))
    for s in seqs[n_dec:]:
        assert pool.reserve(s, args.chunk)

    def mixed_step() -> None:
        batch = [SeqInput(s, [0]) for s in seqs[:n_dec]]
        batch += [SeqInput(s, [0] * args.chunk) for s in seqs[n_dec:]]
        runner.step(batch)
        for item in batch:
            item.seq.length -= len(item.tokens)

    mixed = f"mixed step ({n_dec} decode + {args.prefills} x {args.chunk})"
    ceil_mixed = ceil_decode + ceil_prefill
    rows.append((f"{mixed}, CUDA graph", timed(mixed_step, args.reps), ceil_mixed))
    graphs, runner.graphs = runner.graphs, None
    for backend in ("rows", "split", "reference"):
        runner.backend = backend
        rows.append((f"{mixed}, eager {backend}", timed(mixed_step, args.reps // 2), ceil_mixed))
    runner.backend, runner.graphs = "auto", graphs

    print(
        f"qwen2-7b bf16 on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"batch {args.batch}, contexts {args.context}"
    )
    print(f"{'figure':<58} {'ms':>8} {'ceiling ms':>11} {'ratio':>6}")
    for label, sec, ceil in rows:
        print(f"{label:<58} {sec * 1e3:8.2f} {ceil * 1e3:11.2f} {ceil / sec:6.2f}")
    print(
        f"(ceilings: transformers' batched decode step over DynamicCache {ceil_decode * 1e3:.2f} ms;"
        f" its prefill of {args.prefills} x {args.chunk} tokens after {args.context} "
        f"{ceil_prefill * 1e3:.2f} ms; ratio = ceiling / figure)"
    )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        mixed_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            mixed_step()
            torch.cuda.synchronize()
        table = prof.key_averages().table
        print(table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
        print(table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
