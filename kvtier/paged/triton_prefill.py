"""Causal attention of prompt chunks over a paged KV cache, FlashAttention-2 style, in Triton.

The decode kernel (`kvtier.paged.triton_decode`) gives every query token its own program, which
reads that token's whole context: a prompt chunk of 64 tokens would read its sequence's K/V 64
times, and each read feeds a matrix product one row tall. Here one program takes a *tile* of up
to `BLOCK_M` consecutive tokens of one chunk for one query head: it walks the sequence's K/V in
blocks of `BLOCK_N` tokens, looked up through the block table, and multiplies the whole tile
against each block (`BLOCK_M x dim` by `dim x BLOCK_N` on the tensor cores), with an online
softmax in base 2 (the scale folded into one multiply). Every row of a tile sees the keys before
the tile's first position, so the blocks below it run without a mask; only the last few blocks
(the chunk's own tokens, at most `BLOCK_M + BLOCK_N` keys) apply the causal mask. The 7 query
heads of a GQA group read the same K/V blocks, which their programs, adjacent in the grid, find
in the L2 cache.

Inputs: q `[T, heads, dim]` (the step's new tokens), k/v cache `[num_pages, page_size, kv_heads,
dim]` (one layer of `PagePool.kv`), the block table int32 `[rows, max_pages]`, per token its
context (position + 1, `row_lens`) and block-table row (`row_seq`), and the tiles (first row,
rows) int32: entries with fewer than two rows are not tiles (a decode token's one-row block, or
nothing) and their programs return at once. Writes each tile's rows of `out` `[T, heads, dim]`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvtier.paged.rowblocks import pow2
from kvtier.paged.triton_decode import dot, kv_block

LOG2E = 1.4426950408889634


@triton.jit
def _tile_block(
    q, K, V, BT, seq, kvh, t0, lens, last, m_i, l_i, acc, qk_scale,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
    MASKED: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Fold the keys `t0 .. t0 + BLOCK_N - 1` into the tile's online softmax (base 2).
    Unmasked: every row sees every one of them. Masked: row i sees keys below `lens[i]`, and no
    key at or past `last` (the tile's furthest context) is read."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    t = t0 + tl.arange(0, BLOCK_N)
    if MASKED:
        tmask = t < last
        page = tl.load(BT + seq * stride_bt + t // PAGE, mask=tmask, other=0).to(tl.int64)
        kvmask = tmask[:, None] & dmask[None, :]
    else:
        page = tl.load(BT + seq * stride_bt + t // PAGE).to(tl.int64)
        kvmask = dmask[None, :] & (t[:, None] >= 0)
    off = t % PAGE
    k = kv_block(K, page, off, kvh, stride_kp, stride_ks, stride_kh, d, kvmask)
    qk = dot(q, tl.trans(k), IEEE)
    qk = qk * qk_scale
    if MASKED:
        qk = tl.where(t[None, :] < lens[:, None], qk, float("-inf"))
        # a split's range may start past a row's context: that row has seen no key yet (its
        # running max -inf), and -inf - -inf must not make a NaN
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - base)
        p = tl.math.exp2(qk - base[:, None])
    else:  # every row sees every key here: the running max is finite from the first block on
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = kv_block(V, page, off, kvh, stride_vp, stride_vs, stride_vh, d, kvmask)
    pv = dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _split_of(NTILES, slots, MAX_SPLITS: tl.constexpr):
    """Splits per tile: the step's tiles (`NTILES[0]`) spread over `slots` work slots."""
    ntiles = tl.maximum(tl.load(NTILES), 1)
    return tl.minimum(tl.maximum(slots // ntiles, 1), MAX_SPLITS)


@triton.jit
def _prefill_kernel(
    Q, K, V, BT, LENS, ROWSEQ, TILEROW, TILEN, NTILES, OUT, PART, LSE, qk_scale, slots,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh, stride_pw, stride_ph, stride_pm, stride_lw, stride_lh,
    GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MAX_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)  # the fastest axis: a GQA group's heads run side by side
    w = tl.program_id(1)  # work slot: tile w // splits, split w % splits
    splits = _split_of(NTILES, slots, MAX_SPLITS)
    tile = w // splits
    s = w % splits
    n = tl.load(TILEN + tile, mask=tile < tl.load(NTILES), other=0)
    if n > 1:
        r0 = tl.load(TILEROW + tile)
        seq = tl.load(ROWSEQ + r0)
        first = tl.load(LENS + r0)  # the first row's context: keys below it every row sees
        i = tl.arange(0, BLOCK_M)
        rmask = i < n
        lens = tl.load(LENS + r0 + i, mask=rmask, other=first)
        last = tl.max(lens, 0)
        # this split's keys: the tile's context cut into `splits` ranges of whole blocks
        per = tl.cdiv(tl.cdiv(last, BLOCK_N), splits) * BLOCK_N
        start = s * per
        end = tl.minimum(start + per, last)
        full_end = tl.minimum((first // BLOCK_N) * BLOCK_N, end)
        kvh = head // GROUP
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        qmask = rmask[:, None] & dmask[None, :]
        q = tl.load(
            Q + (r0 + i)[:, None] * stride_qb + head * stride_qh + d[None, :], mask=qmask, other=0.0
        )
        q = q.to(K.dtype.element_ty)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if WHILE_LOOP:  # Triton's CPU interpreter (tests): bounds loaded in-kernel need a while
            t0 = start
            while t0 < full_end:
                m_i, l_i, acc = _tile_block(
                    q, K, V, BT, seq, kvh, t0, lens, last, m_i, l_i, acc, qk_scale,
                    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                    False, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, IEEE,
                )  # fmt: skip
                t0 += BLOCK_N
            t0 = tl.maximum(start, full_end)
            while t0 < end:
                m_i, l_i, acc = _tile_block(
                    q, K, V, BT, seq, kvh, t0, lens, last, m_i, l_i, acc, qk_scale,
                    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                    True, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, IEEE,
                )  # fmt: skip
                t0 += BLOCK_N
        else:  # compiled: for loops, which Triton software-pipelines
            for t0 in range(start, full_end, BLOCK_N):
                m_i, l_i, acc = _tile_block(
                    q, K, V, BT, seq, kvh, t0, lens, last, m_i, l_i, acc, qk_scale,
                    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                    False, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, IEEE,
                )  # fmt: skip
            for t0 in range(tl.maximum(start, full_end), end, BLOCK_N):
                m_i, l_i, acc = _tile_block(
                    q, K, V, BT, seq, kvh, t0, lens, last, m_i, l_i, acc, qk_scale,
                    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                    True, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, IEEE,
                )  # fmt: skip
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        if splits == 1:
            tl.store(
                OUT + (r0 + i)[:, None] * stride_ob + head * stride_oh + d[None, :],
                out.to(OUT.dtype.element_ty),
                mask=qmask,
            )
        else:  # this split's share, merged by _merge_kernel: normalized rows and their lse
            lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            tl.store(
                PART + w * stride_pw + head * stride_ph + i[:, None] * stride_pm + d[None, :],
                out,
                mask=qmask,
            )
            tl.store(LSE + w * stride_lw + head * stride_lh + i, lse, mask=rmask)


@triton.jit
def _merge_kernel(
    TILEROW, TILEN, NTILES, OUT, PART, LSE, slots,
    stride_ob, stride_oh, stride_pw, stride_ph, stride_pm, stride_lw, stride_lh,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):  # fmt: skip
    """Program (head, tile): when the step's tiles were split, merge the splits' shares of the
    tile's rows (weights 2^(lse - max lse)) into `OUT`."""
    head = tl.program_id(0)
    tile = tl.program_id(1)
    splits = _split_of(NTILES, slots, MAX_SPLITS)
    n = tl.load(TILEN + tile, mask=tile < tl.load(NTILES), other=0)
    if splits > 1 and n > 1:
        r0 = tl.load(TILEROW + tile)
        i = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        rmask = i < n
        qmask = rmask[:, None] & (d < HEAD_DIM)[None, :]
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for s in range(0, splits):
            lse = tl.load(LSE + (tile * splits + s) * stride_lw + head * stride_lh + i, mask=rmask)
            top = tl.maximum(top, lse)
        top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for s in range(0, splits):
            w = tile * splits + s
            lse = tl.load(LSE + w * stride_lw + head * stride_lh + i, mask=rmask, other=0.0)
            weight = tl.math.exp2(lse - top)
            part = tl.load(
                PART + w * stride_pw + head * stride_ph + i[:, None] * stride_pm + d[None, :],
                mask=qmask,
                other=0.0,
            )
            total += weight
            acc += weight[:, None] * part
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(
            OUT + (r0 + i)[:, None] * stride_ob + head * stride_oh + d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=qmask,
        )


def default_slots(heads: int, device: torch.device) -> int:
    """Work slots per head for split tiles: about two programs per multiprocessor when a
    step's tiles are few (on the CPU interpreter: 8). On an H200 with 28 heads, 10: two
    64-token chunks at 3,000-token contexts took 91 us a layer with 8 slots, 99 with 15 and
    106 with 1 (bench/paged_attention.py --tune --tune-chunk 64)."""
    if device.type != "cuda":
        return 8
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SLOTS, -(-2 * sms // heads)))


MAX_SLOTS = 64
MAX_SPLITS = 16


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    row_lens: torch.Tensor,
    row_seq: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor],
    num_tiles: int,
    scale: float,
    out: torch.Tensor,
    *,
    count: torch.Tensor | None = None,
    slots: int | None = None,
    block_m: int = 64,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of the step's prompt tiles, written into their rows of `out` (other
    rows untouched); returns `out`.

    `tiles` (first row, rows) int32: the first `count[0]` entries are the step's tiles, each at
    most `block_m` consecutive tokens of one sequence (`kvtier.paged.rowblocks.row_blocks`).
    `num_tiles` bounds `count` (a CUDA graph fixes it: `rowblocks.max_tiles` of its bucket);
    `count` (int32 `[1]` on the device) None: exactly `num_tiles` tiles. Row r attends over the
    first `row_lens[r]` tokens of block-table row `row_seq[r]`.

    When the step has few tiles, each tile's keys are split over several programs (`slots`
    work slots per head, default `default_slots`), whose shares a second pass merges; the
    split is chosen on the device from `count`, so one captured launch serves any step.
    `num_warps` / `num_stages` 4 / 2 and `block_n` 64 (32 for heads wider than 128) when None
    (bench/paged_attention.py --tune, on an H200).
    """
    if num_tiles <= 0:
        return out
    _, heads, dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_prefill needs the head dim contiguous in q and the caches")
    if block_n is None:
        block_n = 64 if dim <= 128 else 32
    if slots is None:
        slots = default_slots(heads, q.device)
    if count is None:
        count = torch.full((1,), num_tiles, dtype=torch.int32, device=q.device)
    block_d = max(16, pow2(dim))
    part = torch.empty((slots, heads, block_m, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((slots, heads, block_m), dtype=torch.float32, device=q.device)
    launch = {"num_warps": num_warps or 4, "num_stages": num_stages or 2}
    strides = (
        out.stride(0), out.stride(1), part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
    )  # fmt: skip
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    _prefill_kernel[(heads, max(num_tiles, slots))](
        q, k_cache, v_cache, block_table, row_lens, row_seq, tiles[0], tiles[1], count, out,
        part, lse, scale * LOG2E, slots,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), *strides,
        GROUP=heads // kv_heads, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=dim,
        BLOCK_D=block_d, MAX_SPLITS=MAX_SPLITS, IEEE=q.dtype == torch.float32,
        WHILE_LOOP=interpreted, **launch,
    )  # fmt: skip
    _merge_kernel[(heads, min(num_tiles, slots))](
        tiles[0], tiles[1], count, out, part, lse, slots, *strides,
        BLOCK_M=block_m, HEAD_DIM=dim, BLOCK_D=block_d, MAX_SPLITS=MAX_SPLITS,
    )  # fmt: skip
    return out
