"""Flash-decoding over a paged KV cache, in Triton (CUDA; imported only when used).

One query token per sequence. Pass 1 splits every sequence's context into `num_splits` ranges;
one program per (sequence, KV head, split) walks its range in blocks of `BLOCK_N` tokens, looks
each token's page up in the block table, and keeps an online softmax (running max `m`, sum `l`,
weighted sum `acc`) for all query heads of its GQA group at once (`tl.dot` over a
`[group, dim] x [dim, BLOCK_N]` tile). It writes a normalized partial output and its
log-sum-exp. Pass 2 merges the partials of each (sequence, head): weights `exp(lse - max lse)`.

Inputs: q `[B, heads, dim]`, k/v cache `[num_pages, page_size, kv_heads, dim]` (one layer of
`PagePool.kv`), block_table int32 `[>=B, max_pages]`, context_lens int32 `[B]`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvtier.paged.rowblocks import pow2 as _pow2


@triton.jit
def kv_block(C, page, off, h, stride_p, stride_s, stride_h, d, mask):
    """One layer's K or V (`C`) for a block of tokens: their pages and offsets in the page, head
    `h`, dims `d`: `[tokens, dims]` (0 where `mask` is off)."""
    addr = C + page[:, None] * stride_p + off[:, None] * stride_s + h * stride_h + d[None, :]
    return tl.load(addr, mask=mask, other=0.0)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """`a @ b` on the tensor cores; in full float32 (`IEEE`) for float32 inputs."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _block(
    q, K, V, BT, row, h, t0, end, m, l_sum, acc, scale,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """One block of BLOCK_N tokens from t0: look pages up, fold into the online softmax."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    t = t0 + tl.arange(0, BLOCK_N)
    tmask = t < end
    page = tl.load(BT + row * stride_bt + t // PAGE, mask=tmask, other=0).to(tl.int64)
    off = t % PAGE
    kvmask = tmask[:, None] & dmask[None, :]
    k = kv_block(K, page, off, h, stride_kp, stride_ks, stride_kh, d, kvmask)
    qk = dot(q, tl.trans(k), IEEE)
    qk = tl.where(tmask[None, :], qk * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(qk - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    v = kv_block(V, page, off, h, stride_vp, stride_vs, stride_vh, d, kvmask)
    pv = dot(p.to(v.dtype), v, IEEE)
    return m_new, l_sum, acc * alpha[:, None] + pv


@triton.jit
def _partial_one(
    Q, K, V, BT, LENS, PART, LSE, scale, num_splits, b, seq, h, s,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    """Pass 1 for query row `b` (one token) over block-table row `seq`, split `s`."""
    length = tl.load(LENS + b)
    # this sequence's own split: its context cut into num_splits ranges of whole blocks, so the
    # grid depends on the batch size only (what a CUDA graph needs) and long and short
    # sequences of one batch each spread over all their programs
    split_len = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, length)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = h * GROUP + g
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
    q = q.to(K.dtype.element_ty)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    if WHILE_LOOP:  # Triton's CPU interpreter (tests): bounds loaded in-kernel need a while
        t0 = start
        while t0 < end:
            m, l_sum, acc = _block(
                q, K, V, BT, seq, h, t0, end, m, l_sum, acc, scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, IEEE,
            )  # fmt: skip
            t0 += BLOCK_N
    else:  # compiled: a for loop, which Triton can software-pipeline
        for t0 in range(start, end, BLOCK_N):
            m, l_sum, acc = _block(
                q, K, V, BT, seq, h, t0, end, m, l_sum, acc, scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, IEEE,
            )  # fmt: skip

    nonempty = l_sum > 0
    out = acc / tl.where(nonempty, l_sum, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, l_sum, 1.0)), float("-inf"))
    tl.store(
        PART + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + d[None, :],
        out,
        mask=gmask[:, None] & dmask[None, :],
    )
    tl.store(LSE + b * stride_lb + heads * stride_lh + s, lse, mask=gmask)


@triton.jit
def _partial_kernel(
    Q, K, V, BT, LENS, ROWSEQ, BLKROW, BLKN, PART, LSE, scale, num_splits,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, WHILE_LOOP: tl.constexpr,
    HAS_ROWSEQ: tl.constexpr,
    HAS_BLOCKS: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(1)
    s = tl.program_id(2)
    if HAS_BLOCKS:
        # program 0-axis j is row block j: `BLKN[j]` rows from `BLKROW[j]`. A block of one row
        # (a decode token) is this kernel's; a prompt tile (several rows) is the prefill
        # kernel's (kvtier.paged.triton_prefill), and an empty entry nobody's.
        r0 = tl.load(BLKROW + tl.program_id(0))
        if tl.load(BLKN + tl.program_id(0)) == 1:
            _partial_one(
                Q, K, V, BT, LENS, PART, LSE, scale, num_splits, r0, tl.load(ROWSEQ + r0), h, s,
                stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                stride_vh, stride_bt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                GROUP, GROUP_PAD, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, IEEE, WHILE_LOOP,
            )  # fmt: skip
    else:
        b = tl.program_id(0)
        # the block-table row of query row b: its sequence's (several rows, one per prompt
        # token, may share one), or row b itself
        if HAS_ROWSEQ:
            seq = tl.load(ROWSEQ + b)
        else:
            seq = b
        _partial_one(
            Q, K, V, BT, LENS, PART, LSE, scale, num_splits, b, seq, h, s,
            stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, stride_bt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
            GROUP, GROUP_PAD, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, IEEE, WHILE_LOOP,
        )  # fmt: skip


@triton.jit
def _reduce_kernel(
    PART, LSE, OUT, BLKROW, BLKN, num_splits,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BLOCKS: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(1)
    if HAS_BLOCKS:  # program j merges the row of block j, if that block is one decode row
        b = tl.load(BLKROW + tl.program_id(0))
        mine = tl.load(BLKN + tl.program_id(0)) == 1
    else:
        b = tl.program_id(0)
        mine = True
    if mine:
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, BLOCK_D)
        smask = s < num_splits
        dmask = d < HEAD_DIM
        lse = tl.load(LSE + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
        top = tl.max(lse, 0)
        w = tl.where(smask, tl.exp(lse - top), 0.0)
        o = tl.load(
            PART + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
            mask=smask[:, None] & dmask[None, :],
            other=0.0,
        )
        out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
        tl.store(OUT + b * stride_outb + h * stride_outh + d, out, mask=dmask)


def default_block_n(head_dim: int) -> int:
    """Tokens per block of the partial pass: 64, or 32 for heads wider than 128."""
    return 64 if head_dim <= 128 else 32


def choose_splits(batch: int, kv_heads: int, max_len: int, block_n: int, sms: int) -> int:
    """Splits per sequence so that about two programs run per multiprocessor."""
    programs = batch * kv_heads
    want = -(-2 * sms // programs)
    return max(1, min(want, -(-max_len // block_n), 64))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    row_seq: torch.Tensor | None = None,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Decode attention of `q` `[B, heads, dim]` over the paged cache; returns `[B, heads, dim]`.

    Row `b` attends over the first `context_lens[b]` tokens of block-table row `row_seq[b]`
    (default: row `b`). With one row per prompt token, `context_lens` its position + 1 and
    `row_seq` its sequence, this is causal prefill attention too, one program per token.
    `max_len` (the longest context) sizes the splits; without it, one device sync reads it.
    `num_warps` / `num_stages` of the first pass: Triton's defaults when None.
    `blocks` (first row, rows) int32 `[B]` each, with `row_seq` (`kvtier.paged.rowblocks`):
    program j takes the row `first[j]` when `rows[j]` is 1; an entry of several rows is a
    prompt tile, which `kvtier.paged.triton_prefill.paged_prefill` attends afterwards into the
    returned tensor (its rows are left unwritten here), and an entry of 0 rows is nothing.
    """
    batch, heads, dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if max_len is None:
        max_len = int(context_lens[:batch].max())
    if block_n is None:
        block_n = default_block_n(dim)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 2
        num_splits = choose_splits(batch, kv_heads, max_len, block_n, sms)
    partial = torch.empty((batch, heads, num_splits, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode needs the head dim contiguous in q and the caches")
    if blocks is not None and row_seq is None:
        raise ValueError("row blocks need row_seq (each row's block-table row)")
    block_d = max(16, _pow2(dim))
    launch = {}
    if num_warps is not None:
        launch["num_warps"] = num_warps
    if num_stages is not None:
        launch["num_stages"] = num_stages
    _partial_kernel[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        context_lens,
        row_seq if row_seq is not None else context_lens,
        blocks[0] if blocks is not None else context_lens,
        blocks[1] if blocks is not None else context_lens,
        partial,
        lse,
        scale,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, _pow2(group)),
        PAGE=page,
        BLOCK_N=block_n,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32,
        WHILE_LOOP=os.environ.get("TRITON_INTERPRET") == "1",
        HAS_ROWSEQ=row_seq is not None,
        HAS_BLOCKS=blocks is not None,
        **launch,
    )
    _reduce_kernel[(batch, heads)](
        partial,
        lse,
        out,
        blocks[0] if blocks is not None else context_lens,
        blocks[1] if blocks is not None else context_lens,
        num_splits,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        SPLITS_PAD=max(2, _pow2(num_splits)),
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        HAS_BLOCKS=blocks is not None,
    )
    return out
