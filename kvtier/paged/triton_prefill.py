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
    k = tl.load(
        K + page[:, None] * stride_kp + off[:, None] * stride_ks + kvh * stride_kh + d[None, :],
        mask=kvmask,
        other=0.0,
    )
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale
    if MASKED:
        qk = tl.where(t[None, :] < lens[:, None], qk, float("-inf"))
    # every row has seen a key by now (the first block holds key 0, which every row sees), so
    # the running max is finite and no row needs a guard against -inf - -inf
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        V + page[:, None] * stride_vp + off[:, None] * stride_vs + kvh * stride_vh + d[None, :],
        mask=kvmask,
        other=0.0,
    )
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _prefill_kernel(
    Q, K, V, BT, LENS, ROWSEQ, TILEROW, TILEN, OUT, qk_scale,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)  # the fastest axis: a GQA group's heads run side by side
    tile = tl.program_id(1)
    n = tl.load(TILEN + tile)
    if n > 1:
        r0 = tl.load(TILEROW + tile)
        seq = tl.load(ROWSEQ + r0)
        first = tl.load(LENS + r0)  # the first row's context: keys below it every row sees
        i = tl.arange(0, BLOCK_M)
        rmask = i < n
        lens = tl.load(LENS + r0 + i, mask=rmask, other=first)
        last = tl.max(lens, 0)
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
        full_end = (first // BLOCK_N) * BLOCK_N
        if WHILE_LOOP:  # Triton's CPU interpreter (tests): bounds loaded in-kernel need a while
            t0 = 0
            while t0 < full_end:
                m_i, l_i, acc = _tile_block(
                    q, K, V, BT, seq, kvh, t0, lens, last, m_i, l_i, acc, qk_scale,
                    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                    False, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, IEEE,
                )  # fmt: skip
                t0 += BLOCK_N
            while t0 < last:
                m_i, l_i, acc = _tile_block(
                    q, K, V, BT, seq, kvh, t0, lens, last, m_i, l_i, acc, qk_scale,
                    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                    True, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, IEEE,
                )  # fmt: skip
                t0 += BLOCK_N
        else:  # compiled: for loops, which Triton software-pipelines
            for t0 in range(0, full_end, BLOCK_N):
                m_i, l_i, acc = _tile_block(
                    q, K, V, BT, seq, kvh, t0, lens, last, m_i, l_i, acc, qk_scale,
                    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                    False, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, IEEE,
                )  # fmt: skip
            for t0 in range(full_end, last, BLOCK_N):
                m_i, l_i, acc = _tile_block(
                    q, K, V, BT, seq, kvh, t0, lens, last, m_i, l_i, acc, qk_scale,
                    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                    True, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, IEEE,
                )  # fmt: skip
        out = acc / l_i[:, None]
        tl.store(
            OUT + (r0 + i)[:, None] * stride_ob + head * stride_oh + d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=qmask,
        )


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
    block_m: int = 64,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of the prompt tiles among the first `num_tiles` entries of `tiles`
    (first row, rows; each tile at most `block_m` consecutive tokens of one sequence), written
    into their rows of `out` (other rows untouched); returns `out`.

    Row r attends over the first `row_lens[r]` tokens of block-table row `row_seq[r]`. A CUDA
    graph fixes `num_tiles` (`kvtier.paged.rowblocks.max_tiles` of its bucket): entries past
    the step's tiles hold fewer than two rows and cost a program that returns at once.
    `num_warps` / `num_stages`: Triton's defaults when None; `block_n` 64 (32 for heads wider
    than 128) when None.
    """
    if num_tiles <= 0:
        return out
    _, heads, dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_prefill needs the head dim contiguous in q and the caches")
    if block_n is None:
        block_n = 64 if dim <= 128 else 32
    launch = {}
    if num_warps is not None:
        launch["num_warps"] = num_warps
    if num_stages is not None:
        launch["num_stages"] = num_stages
    _prefill_kernel[(heads, num_tiles)](
        q, k_cache, v_cache, block_table, row_lens, row_seq, tiles[0], tiles[1], out,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=heads // kv_heads,
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=dim,
        BLOCK_D=max(16, pow2(dim)),
        IEEE=q.dtype == torch.float32,
        WHILE_LOOP=os.environ.get("TRITON_INTERPRET") == "1",
        **launch,
    )  # fmt: skip
    return out
