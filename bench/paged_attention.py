"""One decode attention call over a paged KV cache: what each way of doing it costs.

Shape (defaults): 64 sequences of 3,000 tokens, one new query token each, Qwen2-7B's 28 query /
4 KV heads of 128, bf16, pages of 16 tokens placed at random in the pool (a fragmented pool, as
after hours of serving). Candidates:

  sdpa-contiguous  SDPA flash on per-sequence contiguous K/V (no paging: the ceiling)
  gather+sdpa      gather each sequence's pages into contiguous K/V, then SDPA flash
  triton           kvtier.paged.triton_decode: flash-decoding straight over the block table
  flex             FlexAttention with a block mask whose KV blocks are the pool's pages
  varlen           torch.nn.attention.varlen.varlen_attn(block_table=...), where torch has it
                   (FlashAttention 2 inside: pages of 256 tokens, so it runs on a 256-page pool)

For each: median time per call (CUDA events), per 28-layer decode step, ratio to the ceiling,
and the max abs error against an fp32 reference. `--sweep` times the Triton kernel for page
sizes 8..256. Skips cleanly without CUDA.

    python bench/paged_attention.py
    python bench/paged_attention.py --sweep --batch 32 --context 8000
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cuda_time(fn: Callable[[], object], iters: int = 30, warmup: int = 5) -> float:
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


class Case:
    """Random contiguous K/V per sequence, and the same data scattered into shuffled pages."""

    def __init__(self, batch: int, heads: int, kv_heads: int, dim: int, ctx: int, page: int):
        g = torch.Generator(device="cuda").manual_seed(0)
        dt = torch.bfloat16
        self.batch, self.heads, self.kv_heads, self.dim, self.ctx, self.page = (
            batch,
            heads,
            kv_heads,
            dim,
            ctx,
            page,
        )
        self.q = torch.randn(batch, heads, dim, device="cuda", dtype=dt, generator=g)
        self.k = torch.randn(batch, ctx, kv_heads, dim, device="cuda", dtype=dt, generator=g)
        self.v = torch.randn(batch, ctx, kv_heads, dim, device="cuda", dtype=dt, generator=g)
        per_seq = -(-ctx // page)
        pages = batch * per_seq
        perm = torch.randperm(pages, device="cuda", generator=g)
        self.table = perm.view(batch, per_seq).to(torch.int32)
        self.k_cache = torch.zeros(pages, page, kv_heads, dim, device="cuda", dtype=dt)
        self.v_cache = torch.zeros_like(self.k_cache)
        pad = per_seq * page - ctx
        for src, dst in ((self.k, self.k_cache), (self.v, self.v_cache)):
            padded = F.pad(src, (0, 0, 0, 0, 0, pad)).view(batch, per_seq, page, kv_heads, dim)
            dst[self.table.long()] = padded
        self.lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.scale = dim**-0.5
        # [B, H, 1, D] query and [B, Hkv, L, D] keys for SDPA
        self.q4 = self.q.unsqueeze(2)
        self.k4 = self.k.transpose(1, 2).contiguous()
        self.v4 = self.v.transpose(1, 2).contiguous()

    def reference(self) -> torch.Tensor:
        rep = self.heads // self.kv_heads
        k = self.k4.float().repeat_interleave(rep, 1)
        v = self.v4.float().repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(self.q4.float(), k, v, scale=self.scale)[:, :, 0]


def sdpa_flash(case: Case) -> Callable[[], torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k, v, gqa = case.k4, case.v4, True
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(case.q4, k, v, scale=case.scale, enable_gqa=True)
    except RuntimeError:  # this torch's flash kernel takes no GQA: expand outside the timing
        rep = case.heads // case.kv_heads
        k, v, gqa = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), False

    def run() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(case.q4, k, v, scale=case.scale, enable_gqa=gqa)
        return out[:, :, 0]

    return run


def gather_sdpa(case: Case) -> Callable[[], torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flat_table = case.table.long().flatten()
    b, n, hk, d = case.batch, case.ctx, case.kv_heads, case.dim
    rep = case.heads // hk

    def run() -> torch.Tensor:
        k = case.k_cache.index_select(0, flat_table).view(b, -1, hk, d)[:, :n].transpose(1, 2)
        v = case.v_cache.index_select(0, flat_table).view(b, -1, hk, d)[:, :n].transpose(1, 2)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(case.q4, k, v, scale=case.scale)[:, :, 0]

    return run


def triton_paged(case: Case) -> Callable[[], torch.Tensor]:
    from kvtier.paged.triton_decode import paged_decode

    def run() -> torch.Tensor:
        return paged_decode(
            case.q, case.k_cache, case.v_cache, case.table, case.lens, case.scale, max_len=case.ctx
        )

    return run


def flex_paged(case: Case) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    pages, page = case.k_cache.shape[:2]
    logical = torch.empty(pages, dtype=torch.int32, device="cuda")
    logical[case.table.flatten().long()] = torch.arange(
        case.table.shape[1], device="cuda", dtype=torch.int32
    ).repeat(case.batch)
    owner = torch.empty(pages, dtype=torch.int32, device="cuda")
    owner[case.table.flatten().long()] = torch.arange(
        case.batch, device="cuda", dtype=torch.int32
    ).repeat_interleave(case.table.shape[1])
    lens = case.lens

    def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        # The block mask already limits each sequence to its pages; the mask also says so,
        # for the partial last page and for paths that apply mask_mod densely.
        page_id = kv_idx // page
        return (owner[page_id] == b) & (logical[page_id] * page + kv_idx % page < lens[b])

    num = torch.full((case.batch, 1, 1), case.table.shape[1], dtype=torch.int32, device="cuda")
    # kv_indices must be as wide as the KV length in blocks; entries past kv_num_blocks are unused
    indices = torch.zeros(case.batch, 1, 1, pages, dtype=torch.int32, device="cuda")
    indices[:, 0, 0, : case.table.shape[1]] = case.table
    block_mask = BlockMask.from_kv_blocks(
        num,
        indices,
        BLOCK_SIZE=(1, page),
        mask_mod=mask_mod,
        seq_lengths=(1, pages * page),
    )
    k = case.k_cache.view(1, pages * page, case.kv_heads, case.dim).transpose(1, 2)
    v = case.v_cache.view(1, pages * page, case.kv_heads, case.dim).transpose(1, 2)
    k = k.expand(case.batch, -1, -1, -1)
    v = v.expand(case.batch, -1, -1, -1)
    compiled = torch.compile(flex_attention, dynamic=False)

    def run() -> torch.Tensor:
        out = compiled(case.q4, k, v, block_mask=block_mask, scale=case.scale, enable_gqa=True)
        assert isinstance(out, torch.Tensor)
        return out[:, :, 0]

    return run


def varlen_paged(case: Case) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.varlen import varlen_attn

    cu_q = torch.arange(case.batch + 1, dtype=torch.int32, device="cuda")
    cu_k = cu_q * case.ctx

    def run() -> torch.Tensor:
        out = varlen_attn(
            case.q,
            case.k_cache,
            case.v_cache,
            cu_q,
            cu_k,
            1,
            case.ctx,
            scale=case.scale,
            enable_gqa=True,
            seqused_k=case.lens,
            block_table=case.table,
        )
        assert isinstance(out, torch.Tensor)
        return out

    return run


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=28, help="layers per decode step")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiles)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the Triton page size")
    ap.add_argument(
        "--tune",
        action="store_true",
        help="also sweep the Triton kernel's launch (splits, block of tokens, warps, stages) for "
        "decode rows, and the prefill kernel's for a mixed step's prompt chunks beside them",
    )
    ap.add_argument("--tune-chunk", type=int, default=64, help="--tune: prompt chunk tokens")
    ap.add_argument(
        "--tune-tiles", type=ints, default=[32, 64, 128], help="--tune: prefill tile tokens"
    )
    ap.add_argument("--tune-splits", type=ints, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument(
        "--tune-slots", type=ints, default=[1, 8, 16, 32], help="--tune: prefill work slots"
    )
    ap.add_argument("--tune-block-n", type=ints, default=[32, 64])
    ap.add_argument("--tune-warps", type=ints, default=[4, 8])
    ap.add_argument("--tune-stages", type=ints, default=[2, 3, 4])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("paged_attention: no CUDA device; nothing to measure (skipped)")
        return
    from kvtier.paged.attention import varlen_block_table_supported

    shape = (args.batch, args.heads, args.kv_heads, args.head_dim, args.context)
    case = Case(*shape, args.page_size)
    ref = case.reference()
    print(
        f"decode attention: batch {args.batch}, {args.heads} q / {args.kv_heads} kv heads x "
        f"{args.head_dim}, context {args.context}, bf16, page {args.page_size}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    candidates: dict[str, Callable[[Case], Callable[[], torch.Tensor]]] = {
        "sdpa-contiguous": sdpa_flash,
        "gather+sdpa": gather_sdpa,
        "triton": triton_paged,
    }
    if not args.no_flex:
        candidates["flex"] = flex_paged
    candidates["varlen"] = varlen_paged
    print(f"{'candidate':<16} {'us/call':>9} {'ms/step':>9} {'x ceiling':>9} {'max abs err':>12}")
    ceiling = None
    for name, build in candidates.items():
        if name == "varlen" and not varlen_block_table_supported():
            print(f"{name:<16} {'-':>9} {'-':>9} {'-':>9}  not in this torch ({torch.__version__})")
            continue
        run_case = case
        if name == "varlen" and case.page % 256:  # FlashAttention 2's paged KV: pages of 256
            run_case = Case(*shape, 256)
            name = "varlen (p256)"
        try:
            fn = build(run_case)
            err = (fn().float() - ref).abs().max().item()
            sec = cuda_time(fn, args.iters)
        except Exception as exc:  # a candidate this torch/GPU cannot run: report, go on
            first = (str(exc).splitlines() or [""])[0][:90]
            print(f"{name:<16} failed: {type(exc).__name__}: {first}")
            continue
        if name == "sdpa-contiguous":
            ceiling = sec
        ratio = f"{sec / ceiling:9.2f}" if ceiling is not None else f"{'-':>9}"
        print(f"{name:<16} {sec * 1e6:9.1f} {sec * args.layers * 1e3:9.2f} {ratio} {err:12.2e}")
    if args.sweep:
        top = f"{ceiling * 1e6:.1f} us" if ceiling is not None else "not measured"
        print(f"\ntriton page-size sweep (same data; ceiling {top})")
        print(f"{'page':>6} {'us/call':>9} {'ms/step':>9} {'max abs err':>12}")
        for page in (8, 16, 32, 64, 128, 256):
            swept = Case(*shape, page)
            fn = triton_paged(swept)
            err = (fn().float() - ref).abs().max().item()
            sec = cuda_time(fn, args.iters)
            print(f"{page:>6} {sec * 1e6:9.1f} {sec * args.layers * 1e3:9.2f} {err:12.2e}")
            del swept
    if args.tune:
        tune(case, ref, args)


def memcpy_seconds(nbytes: int, iters: int) -> float:
    """The same bytes copied device to device: the bandwidth ceiling of reading K/V once
    (a copy reads and writes each byte, so half its time is the read)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return cuda_time(lambda: dst.copy_(src), iters) / 2


def tune(case: Case, ref: torch.Tensor, args: argparse.Namespace) -> None:
    """Time the decode kernel over its launch parameters, then a mixed call (the decode rows of
    batch - 2 sequences and two `--tune-chunk`-token prompt chunks at the end of their contexts)
    with the prompt rows through the prefill kernel over its own (`--tune-tiles`: tokens per
    tile; block, warps, stages), each checked against the one-row-per-program path; print the
    best against reading the K/V once at memcpy speed, and the prefill kernel alone against SDPA
    flash over the same chunks' contiguous K/V (the compute ceiling)."""
    import itertools

    from kvtier.paged.triton_decode import choose_splits, default_block_n, paged_decode

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_bytes = 2 * case.batch * case.ctx * case.kv_heads * case.dim * 2
    floor = memcpy_seconds(kv_bytes, args.iters)
    default_splits = choose_splits(
        case.batch, case.kv_heads, case.ctx, default_block_n(case.dim), sms
    )
    results = []
    grid = itertools.product(args.tune_splits, args.tune_block_n, args.tune_warps, args.tune_stages)
    for splits, block_n, warps, stages in grid:
        launch = {"num_splits": splits, "block_n": block_n, "num_warps": warps}
        launch["num_stages"] = stages
        sec = _checked(
            lambda launch=launch: paged_decode(  # type: ignore[misc]
                case.q, case.k_cache, case.v_cache, case.table, case.lens, case.scale,
                max_len=case.ctx, **launch,
            ),
            ref, args.iters, f"decode {launch}",
        )  # fmt: skip
        if sec is not None:
            results.append((sec, splits, block_n, warps, stages))
    results.sort()
    print(
        f"\ntriton launch sweep, decode rows ({case.batch} rows; K/V read once at memcpy speed: "
        f"{floor * 1e6:.1f} us; default splits {default_splits}, block "
        f"{default_block_n(case.dim)}, 4 warps, 3 stages)"
    )
    print(f"{'us/call':>9} {'x floor':>8} {'splits':>7} {'block':>6} {'warps':>6} {'stages':>7}")
    for sec, splits, block_n, warps, stages in results[:8]:
        print(
            f"{sec * 1e6:9.1f} {sec / floor:8.2f} {splits:>7} {block_n:>6} {warps:>6} {stages:>7}"
        )
    base = [r for r in results if r[1:] == (default_splits, default_block_n(case.dim), 4, 3)]
    if base:
        print(f"{base[0][0] * 1e6:9.1f} {base[0][0] / floor:8.2f}  (the default launch)")
    tune_mixed(case, floor, args)


def _checked(
    fn: Callable[[], torch.Tensor], want: torch.Tensor, iters: int, what: str
) -> float | None:
    """Seconds per call of `fn`, after checking its output against `want`; None (and a line
    saying why) for a launch this GPU cannot take or a wrong result."""
    try:
        err = (fn().float() - want).abs().max().item()
        if err > 2e-2:
            raise ValueError(f"max abs error {err:.2e}")
        return cuda_time(fn, iters)
    except Exception as exc:
        print(f"  {what}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:80]}")
        return None


def tune_mixed(case: Case, floor: float, args: argparse.Namespace) -> None:
    """The mixed call of `tune`: decode rows by the default decode launch, prompt tiles by each
    prefill launch; and the prompt rows as one decode row each (the path without tiles)."""
    import itertools

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from kvtier.paged.rowblocks import count_tiles, row_blocks
    from kvtier.paged.triton_decode import paged_decode
    from kvtier.paged.triton_prefill import default_slots, paged_prefill

    chunk, n_dec, dev = args.tune_chunk, case.batch - 2, "cuda"
    query_lens = [1] * n_dec + [chunk, chunk]
    row_seq = [i for i, n in enumerate(query_lens) for _ in range(n)]
    row_len = [case.ctx] * n_dec + list(range(case.ctx - chunk + 1, case.ctx + 1)) * 2
    q = torch.randn(len(row_seq), case.heads, case.dim, device=dev, dtype=torch.bfloat16)
    r_seq = torch.tensor(row_seq, dtype=torch.int32, device=dev)
    r_len = torch.tensor(row_len, dtype=torch.int32, device=dev)
    common = (q, case.k_cache, case.v_cache, case.table, r_len, case.scale)
    want = paged_decode(*common, max_len=case.ctx, row_seq=r_seq).float()
    one_row = cuda_time(lambda: paged_decode(*common, max_len=case.ctx, row_seq=r_seq), args.iters)
    # the compute ceiling of the prompt rows: SDPA flash, the two chunks' queries over their
    # contiguous K/V (heads expanded), the causal mask aligned to the end of the context
    rep = case.heads // case.kv_heads
    pq = q[n_dec:].view(2, chunk, case.heads, case.dim).transpose(1, 2)
    pk = case.k4[-2:].repeat_interleave(rep, 1)
    pv = case.v4[-2:].repeat_interleave(rep, 1)
    mask = causal_lower_right(chunk, case.ctx)

    def flash() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(pq, pk, pv, attn_mask=mask, scale=case.scale)

    flash_sec = cuda_time(flash, args.iters)
    flops = 4 * 2 * case.heads * case.dim * sum(range(case.ctx - chunk + 1, case.ctx + 1))
    results = []
    for tile in args.tune_tiles:
        first, count = row_blocks(query_lens, tile)
        tiles = count_tiles(query_lens, tile)
        pad = len(row_seq) - len(first)
        blocks = (
            torch.tensor(first + [0] * pad, dtype=torch.int32, device=dev),
            torch.tensor(count + [0] * pad, dtype=torch.int32, device=dev),
        )
        for block_n, warps, stages, slots in itertools.product(
            args.tune_block_n, args.tune_warps, args.tune_stages, args.tune_slots
        ):
            launch = {"block_m": tile, "block_n": block_n, "num_warps": warps}
            launch |= {"num_stages": stages, "slots": slots}

            def mixed(blocks=blocks, tiles=tiles, launch=launch) -> torch.Tensor:  # type: ignore[no-untyped-def]
                out = paged_decode(*common, max_len=case.ctx, row_seq=r_seq, blocks=blocks)
                return paged_prefill(
                    q, case.k_cache, case.v_cache, case.table, r_len, r_seq, blocks, tiles,
                    case.scale, out, **launch,
                )  # fmt: skip

            sec = _checked(mixed, want, args.iters, f"mixed {launch}")
            if sec is None:
                continue
            out = torch.empty_like(q)

            def prefill(blocks=blocks, tiles=tiles, launch=launch, out=out) -> torch.Tensor:  # type: ignore[no-untyped-def]
                return paged_prefill(
                    q, case.k_cache, case.v_cache, case.table, r_len, r_seq, blocks, tiles,
                    case.scale, out, **launch,
                )  # fmt: skip

            results.append(
                (sec, cuda_time(prefill, args.iters), tile, block_n, warps, stages, slots)
            )
    results.sort()
    print(
        f"\nmixed call: {n_dec} decode rows + 2 x {chunk}-token chunks ({len(row_seq)} rows) at "
        f"{case.ctx:,}-token contexts; K/V read once at memcpy speed {floor * 1e6:.1f} us; "
        f"every row one decode program (no tiles) {one_row * 1e6:.1f} us"
    )
    print(
        f"prompt rows' compute ceiling: SDPA flash over their contiguous K/V {flash_sec * 1e6:.1f}"
        f" us ({flops / flash_sec / 1e12:.0f} TFLOP/s)"
    )
    print(
        f"{'us/call':>9} {'x floor':>8} {'prefill us':>11} {'TFLOP/s':>8} {'x flash':>8} "
        f"{'tile':>5} {'block':>6} {'warps':>6} {'stages':>7} {'slots':>6}"
    )
    default = (64, 64, 4, 2, default_slots(case.heads, q.device))
    for sec, alone, *setting in results[:10] + [r for r in results if tuple(r[2:]) == default]:
        tile, block_n, warps, stages, slots = setting
        print(
            f"{sec * 1e6:9.1f} {floor / sec:8.2f} {alone * 1e6:11.1f} "
            f"{flops / alone / 1e12:8.0f} {flash_sec / alone:8.2f} {tile:>5} {block_n:>6} "
            f"{warps:>6} {stages:>7} {slots:>6}"
            + ("  (the default)" if tuple(setting) == default else "")
        )


if __name__ == "__main__":
    main()
