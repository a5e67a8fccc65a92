"""A prompt chunk's attention over a long context: the bytes it holds and its time, with every
query head's K/V repeated at once (the path before `FLASH_KV_BYTES`) and in groups of heads
(kvtier.paged.reference._flash_lower_right), against the GPU memory plan's term for it.

`python3 bench/gpu_long_prefill.py` (CUDA, the Qwen2-7B shape with random bf16 weights, about a
minute on an H100) prints two tables:

- one layer of one row: a `--chunk`-token prompt chunk over each of `--contexts` (16K and 24K
  tokens, those of the two returning turns that went out of memory on an H100 under a 24 GiB
  budget), old path and new: the peak bytes allocated beyond the inputs
  (`torch.cuda.max_memory_allocated`), the time per call and its ratio, the largest difference
  of their results, and the plan's term (`attention_estimate`, the formula; `profile_attention`,
  what the server's plan takes on this device);
- one batched step of the model (eager, the `split` attention the server's mixed steps take
  on CUDA): the two prefilling rows at those contexts beside `--decode` decode rows, old path
  and new: the step's peak beyond what was allocated before it, its time, against the plan's
  activations (the profiled forward at the step's size plus the term).

`--device cpu --shape qwen2-tiny` runs the same on the CPU at small contexts (a smoke test:
no peaks there, the ratio and the results' difference only). Exit status 1 when the new path's
results differ from the old path's by more than `--tolerance`, or its peak on CUDA is past the
plan's term.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from models import SHAPES, build, sync  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.paged import reference  # noqa: E402
from kvtier.server.devices import memplan  # noqa: E402

MiB = 2**20


def old_flash(
    qi: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    n_k: int,
    scale: float,
    budget: int = 0,
) -> torch.Tensor:
    """The path before groups of heads: the row's pages gathered for every KV head, cast, then
    every query head's K/V repeated at once, one SDPA call."""
    group = qi.shape[1] // k_cache.shape[2]
    k = k_cache.index_select(0, pages).flatten(0, 1)[:n_k]
    v = v_cache.index_select(0, pages).flatten(0, 1)[:n_k]
    kk = k.transpose(0, 1).to(qi.dtype)
    vv = v.transpose(0, 1).to(qi.dtype)
    if group > 1:
        kk = kk.repeat_interleave(group, dim=0)
        vv = vv.repeat_interleave(group, dim=0)
    o = F.scaled_dot_product_attention(
        qi.transpose(0, 1)[None],
        kk[None],
        vv[None],
        attn_mask=causal_lower_right(qi.shape[0], n_k),
        scale=scale,
    )
    return o[0].transpose(0, 1)


NEW = reference._flash_lower_right  # the function under test
PATHS = {"old": old_flash, "new": NEW}


def measured(fn: Callable[[], Any], device: str, reps: int) -> tuple[Any, int | None, float]:
    """fn's result, its peak bytes beyond what was allocated before it (CUDA), seconds a call."""
    peak = None
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    out = fn()
    sync(device)
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() - base
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return out, peak, (time.perf_counter() - t0) / reps


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def one_row(args: argparse.Namespace, geo: KVGeometry, heads: int, dtype: torch.dtype) -> bool:
    """Table 1: one layer of one row per context; False where the new path fails a check."""
    dev, ok = args.device, True
    page = memplan.page_size(torch.device(dev), dtype)
    print(
        f"\none layer, one row: a {args.chunk}-token chunk, {heads} query heads over "
        f"{geo.num_kv_heads} KV heads of {geo.head_dim}, {dtype}, pages of {page}"
    )
    print(
        f"{'context':>8} {'old MiB':>8} {'new MiB':>8} {'term MiB':>9} {'measured':>9} "
        f"{'old ms':>8} {'new ms':>8} {'new/old':>8} {'max diff':>9}"
    )
    for n_k in args.contexts:
        pages = -(-n_k // page)
        gen = torch.Generator(device=dev).manual_seed(n_k)
        shape = (pages + 4, page, geo.num_kv_heads, geo.head_dim)
        k_cache = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
        v_cache = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
        table = torch.randperm(pages + 4, generator=gen, device=dev)[:pages].to(torch.int32)
        q = torch.randn(args.chunk, heads, geo.head_dim, generator=gen, device=dev, dtype=dtype)
        results: dict[str, tuple[Any, int | None, float]] = {}
        with torch.inference_mode():
            for name, fn in PATHS.items():
                call = functools.partial(fn, q, k_cache, v_cache, table, n_k, geo.head_dim**-0.5)
                results[name] = measured(call, dev, args.reps)
        term = memplan.attention_estimate(geo, heads, n_k, args.chunk, page)
        on_device = None
        if dev.startswith("cuda"):
            on_device = memplan.profile_attention(
                geo, heads, n_k, args.chunk, torch.device(dev), dtype
            )
        (old, old_peak, old_s), (new, new_peak, new_s) = results["old"], results["new"]
        diff = (old.float() - new.float()).abs().max().item()
        print(
            f"{n_k:>8} {mib(old_peak):>8} {mib(new_peak):>8} {mib(term):>9} "
            f"{mib(on_device):>9} {old_s * 1e3:>8.3f} {new_s * 1e3:>8.3f} "
            f"{new_s / old_s:>8.2f} {diff:>9.2g}"
        )
        if diff > args.tolerance:
            print(f"FAIL: the new path's results differ from the old path's by {diff}")
            ok = False
        if new_peak is not None and on_device is not None and new_peak > on_device:
            print(f"FAIL: the new path held {mib(new_peak)} MiB, past the plan's term")
            ok = False
        del old, new, results
    return ok


def one_step(args: argparse.Namespace, model: Any, geo: KVGeometry, dtype: torch.dtype) -> bool:
    """Table 2: one batched step, eager, the split attention (CUDA); False where the new path's
    step holds more than the plan's activations."""
    from kvtier.paged import BatchRunner, PagedSequence, PagePool, SeqInput

    dev = torch.device(args.device)
    heads = int(model.config.num_attention_heads)
    page = memplan.page_size(dev, dtype)
    longest = max(args.contexts)
    tokens = args.decode + len(args.contexts) * args.chunk
    need = (
        sum(n + args.chunk + page for n in args.contexts)
        + args.decode * (args.decode_context + 2 * page)
        + 4 * page
    )
    pool = PagePool(geo, need * geo.bytes_per_token, page_size=page, device=dev, dtype=dtype)
    pool.kv.normal_(0, 0.5)
    runner = BatchRunner(
        model,
        pool,
        max_batch=args.decode + len(args.contexts),
        max_tokens=tokens,
        max_seq_len=longest + args.chunk + page,
        backend="split",
    )
    seqs = []
    for n in [args.decode_context] * args.decode + list(args.contexts):
        s = PagedSequence()
        assert pool.reserve(s, n)
        s.length = n
        seqs.append(s)
    n_dec = args.decode

    def step() -> None:
        batch = [SeqInput(s, [0]) for s in seqs[:n_dec]]
        batch += [SeqInput(s, [0] * args.chunk) for s in seqs[n_dec:]]
        runner.step(batch)
        for item in batch:
            item.seq.length -= len(item.tokens)

    term = memplan.profile_attention(geo, heads, longest, tokens, dev, dtype)
    profiled = memplan.profile_activations(model, tokens, len(seqs), dev)
    print(
        f"\none batched step: {n_dec} decode rows at {args.decode_context} tokens + "
        f"{len(args.contexts)} prompt chunks of {args.chunk} over "
        f"{', '.join(map(str, args.contexts))} tokens ({tokens} new tokens), eager, split"
    )
    print(
        f"plan: activations {mib(profiled + term)} MiB = profiled forward "
        f"{mib(profiled)} + prefill attention at {longest} tokens {mib(term)}"
    )
    print(f"{'round':>5} {'path':>6} {'step peak MiB':>14} {'step ms':>9}")
    ok, times = True, {name: [] for name in PATHS}
    for r in range(args.rounds):  # old, new, then new, old, ...: neither always runs first
        for name in list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]:
            reference._flash_lower_right = PATHS[name]  # the step's prefill rows take it
            try:
                _, peak, secs = measured(step, args.device, args.reps)
            finally:
                reference._flash_lower_right = NEW
            times[name].append(secs)
            print(f"{r:>5} {name:>6} {mib(peak):>14} {secs * 1e3:>9.2f}")
            if name == "new" and peak is not None and peak > profiled + term:
                print(f"FAIL: the step held {mib(peak)} MiB, past the plan's activations")
                ok = False
    ratio = statistics.median(times["new"]) / statistics.median(times["old"])
    print(f"step time new/old (medians of {args.rounds} rounds): {ratio:.2f}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen2-7b", choices=sorted(SHAPES))
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="tokens of context")
    ap.add_argument("--chunk", type=int, default=None, help="prompt tokens of each chunk")
    ap.add_argument("--decode", type=int, default=30, help="decode rows beside the prompts")
    ap.add_argument("--decode-context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4, help="batched-step rounds, order alternated")
    ap.add_argument("--tolerance", type=float, default=1e-2)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: pass --device cpu --shape qwen2-tiny")
    args.contexts = args.contexts or ([16384, 24576] if cuda else [160, 240])
    args.chunk = args.chunk or (512 if cuda else 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    started = time.perf_counter()
    model = build(args.shape, args.device, dtype)
    geo = KVGeometry.from_config(model.config, dtype=str(dtype).removeprefix("torch."))
    ok = one_row(args, geo, int(model.config.num_attention_heads), dtype)
    if cuda:
        ok = one_step(args, model, geo, dtype) and ok
    print(f"\n{'PASS' if ok else 'FAIL'} in {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
