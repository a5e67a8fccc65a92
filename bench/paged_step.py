"""One batched step of the paged runner, by kind, against transformers' own batched step.

`PYTHONPATH=. python3 bench/paged_step.py [--batch 64] [--context 3000] [--chunk 512]
[--prefills 2] [--profile] [--breakdown] [--compile]` builds the Qwen2-7B shape with random bf16
weights (CUDA), fills `--batch` paged sequences with `--context` tokens of random K/V (the
values do not change the timing), and times:

- a decode-only step: eager, and replayed from a CUDA graph;
- a mixed step: the decode rows of `--batch - --prefills` sequences plus `--prefills` prompt
  chunks of `--chunk` tokens appended to `--context`-token contexts: replayed from a CUDA graph,
  and eager on each attention backend that takes it (rows, split, reference);
- both again with decode-only graphs, then with the fused kernels (kvtier.paged.fused): the
  norms and MLPs first, then the attention's rotary with its page write and q/k/v as one GEMM
  too (what the server's `fused_kernels` swaps);

against the ceilings measured in the same run: transformers' batched decode step over
`DynamicCache` (every context resident, SDPA), and that decode step plus the prompt chunks
prefilled alone (their `DynamicCache` forward). `--profile` prints the top operators of one mixed
step (torch.profiler).

`--breakdown` splits the GPU time of one decode-only step and one mixed step by kernel kind
(torch.profiler, eager: the same kernels a graph replays) and sets each kind against its floor
in the same run: the weight matmuls against reading every linear layer's weights once, the
paged attention against reading every sequence's K/V once, both at the device-to-device copy
speed measured here; the model is fused by then. The all-fused graphs' replay alone (timed
with CUDA events; a decode-only step replays its decode-only graph) beyond the kernels' sum is
the gaps between them; the graph step beyond the replay is its host work (the step's inputs).
The decode step is also broken down through the one-row kernel alone (the eager decode-only
path), against the graphs' kernel, which has the prompt rows' code compiled in. It prints the
step a throughput needs at this batch, so the distance to a target reads off the table.
`--compile` first compiles every layer's RMSNorms and MLP with torch.compile (an experiment:
what fusing their small kernels saves; the server does not do it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from models import build

from kvtier.geometry import KVGeometry
from kvtier.integrations.hf import cache_kwarg
from kvtier.paged import BatchRunner, PagedSequence, PagePool, SeqInput

#: substrings of the kernel names of dense matmuls (cuBLAS / CUTLASS on Hopper and before)
MATMUL_MARKS = ("gemm", "cutlass", "xmma", "nvjet", "matmul", "cublas")
#: the paged attention's kernels (kvtier/paged/triton_decode.py, triton_prefill.py)
ATTENTION_MARKS = ("_partial_kernel", "_reduce_kernel", "_prefill_kernel")


def kernel_kind(name: str) -> str:
    """`matmul`, `attention` or `other`, by a CUDA kernel's name."""
    low = name.lower()
    if any(mark in low for mark in ATTENTION_MARKS):
        return "attention"
    if any(mark in low for mark in MATMUL_MARKS):
        return "matmul"
    return "other"


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
    ap.add_argument(
        "--breakdown", action="store_true", help="GPU time by kernel kind against its floor"
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each layer's RMSNorms and MLP first (fusing their small kernels)",
    )
    ap.add_argument(
        "--target", type=float, default=6000.0, help="tok/s whose step time --breakdown prints"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("paged_step.py measures CUDA steps: no CUDA device here")
    dev = "cuda"
    model = build("qwen2-7b", dev, torch.bfloat16)
    geo = KVGeometry.from_config(model.config, dtype="bfloat16")
    if args.compile:
        compile_small(model)
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
    decode_graph = timed(decode_step, args.reps)
    rows.append(("decode-only step, CUDA graph", decode_graph, ceil_decode))
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
    mixed_graph = timed(mixed_step, args.reps)
    rows.append((f"{mixed}, CUDA graph", mixed_graph, ceil_mixed))
    graphs, runner.graphs = runner.graphs, None
    for backend in ("rows", "split", "reference"):
        runner.backend = backend
        rows.append((f"{mixed}, eager {backend}", timed(mixed_step, args.reps // 2), ceil_mixed))
    runner.backend = "auto"
    # the same steps with a decode-only graph per bucket (the one-row kernel, no row blocks
    # compiled in) beside the batched one: what a step without prompt rows gains from it
    runner.capture_graphs([args.batch, mixed_tokens], decode_graphs=True)
    one_row = timed(decode_step, args.reps)
    rows.append(("decode-only step, decode-only CUDA graph", one_row, ceil_decode))
    rows.append(
        (f"{mixed}, CUDA graph (decode graphs on)", timed(mixed_step, args.reps), ceil_mixed)
    )
    runner.graphs = graphs
    # every RMSNorm and SiLU-and-multiply as one kernel (kvtier.paged.fused), graphs again
    from kvtier.paged.fused import fuse_model

    fused_modules = fuse_model(model, kinds=("norm", "mlp"))
    runner.capture_graphs([args.batch, mixed_tokens], decode_graphs=True)
    rows.append(
        (
            f"decode-only step, both, {fused_modules} norms and MLPs fused",
            timed(decode_step, args.reps),
            ceil_decode,
        )
    )
    rows.append((f"{mixed}, CUDA graph, fused", timed(mixed_step, args.reps), ceil_mixed))
    # then each attention's rotary and page write as one kernel, its q/k/v as one GEMM
    # (kvtier.paged.fused_rope): everything the server's fused_kernels swaps
    attentions = fuse_model(model, kinds=("attention",))
    runner.capture_graphs([args.batch, mixed_tokens], decode_graphs=True)
    decode_graph = timed(decode_step, args.reps)
    rows.append(
        (f"decode-only step, both, {attentions} attentions fused too", decode_graph, ceil_decode)
    )
    mixed_graph = timed(mixed_step, args.reps)
    rows.append((f"{mixed}, CUDA graph, all fused", mixed_graph, ceil_mixed))
    # the breakdown below replays these graphs (everything fused; a decode-only step its
    # decode-only graph), beside the two steps just timed
    graphs = runner.graphs

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
    if args.breakdown:
        from paged_attention import cuda_time, memcpy_seconds

        linear = sum(
            m.weight.numel() * m.weight.element_size()
            for m in model.modules()
            if isinstance(m, torch.nn.Linear)
        )
        kv_decode = args.batch * args.context * geo.bytes_per_token
        kv_mixed = kv_decode + args.prefills * args.chunk * geo.bytes_per_token
        read_ms = memcpy_seconds(1 << 31, 10) / (1 << 31) * 1e3  # per byte, read at copy speed
        assert graphs is not None
        decode_step()  # the graphs' buffers hold a decode-only step: replay it alone
        decode_replay = cuda_time(lambda: graphs.replay(args.batch, True), args.reps) * 1e3
        mixed_step()
        mixed_replay = cuda_time(lambda: graphs.replay(mixed_tokens), args.reps) * 1e3
        runner.graphs, runner.backend = None, "rows"  # eager, the graphs' attention path
        print()
        decode_graph_ms, mixed_graph_ms = decode_graph * 1e3, mixed_graph * 1e3
        breakdown(
            "decode-only", decode_step, linear, kv_decode, read_ms, (decode_replay, decode_graph_ms)
        )
        breakdown(mixed, mixed_step, linear, kv_mixed, read_ms, (mixed_replay, mixed_graph_ms))
        # the same decode step through the decode-only kernel (no row blocks compiled in), as
        # eager decode-only steps run it: what the graphs' one kernel for every step costs
        runner.backend = "triton"
        breakdown("decode-only, decode kernel", decode_step, linear, kv_decode, read_ms)
        runner.graphs, runner.backend = graphs, "auto"
        need = args.batch / args.target * 1e3
        print(
            f"{args.target:,.0f} tok/s at batch {args.batch} needs a decode-only step of "
            f"{need:.2f} ms (the graph step above: {decode_graph_ms:.2f} ms)"
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


def compile_small(model: torch.nn.Module) -> None:
    """torch.compile every decoder layer's two RMSNorms and MLP, and the final norm: their
    elementwise kernels fuse (the attention and its page writes stay as they are)."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 64  # one graph per step size (graph bucket)
    inner = model.model  # type: ignore[attr-defined]
    for layer in inner.layers:
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            getattr(layer, name).compile(dynamic=False)
    inner.norm.compile(dynamic=False)


def breakdown(
    label: str,
    step: Callable[[], None],
    weight_bytes: int,
    kv_bytes: int,
    read_ms: float,
    graph: tuple[float, float] | None = None,
) -> None:
    """Print one step's kernel time by kind against the floor of what it reads (`read_ms` a
    byte at copy speed), and with `graph` (its replay alone, the step with its host work; ms)
    what the graph adds to the kernels."""
    from torch.profiler import ProfilerActivity, profile

    reps = 3
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    by_kind = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    other: dict[str, float] = {}
    launches = 0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        launches += 1
        ms = evt.time_range.elapsed_us() / 1e3 / reps
        kind = kernel_kind(evt.name)
        by_kind[kind] += ms
        if kind == "other":
            other[evt.name] = other.get(evt.name, 0.0) + ms
    floors = {"matmul": weight_bytes, "attention": kv_bytes}
    print(f"{label}: GPU time by kernel kind (eager; a graph replays the same kernels)")
    print(f"  {'kind':<34} {'ms':>8} {'floor ms':>9} {'ratio':>6}")
    for kind, ms in by_kind.items():
        if kind in floors:
            floor = floors[kind] * read_ms
            what = "weights" if kind == "matmul" else "K/V"
            name = f"{kind} (reads {floors[kind] / 1e9:.1f} GB of {what})"
            print(f"  {name:<34} {ms:8.2f} {floor:9.2f} {floor / ms:6.2f}")
        else:
            print(f"  {kind:<34} {ms:8.2f} {'':>9} {'':>6}")
    kernels = sum(by_kind.values())
    print(f"  {f'all kernels ({launches / reps:.0f})':<34} {kernels:8.2f}")
    if graph is not None:
        print(f"  {'graph replay alone (CUDA events)':<34} {graph[0]:8.2f}")
        print(f"  {'graph step (with its host work)':<34} {graph[1]:8.2f}")
    top = sorted(other.items(), key=lambda kv: -kv[1])[:6]
    print("  largest other kernels: " + "; ".join(f"{n[:60]} {ms:.2f} ms" for n, ms in top))


if __name__ == "__main__":
    main()
