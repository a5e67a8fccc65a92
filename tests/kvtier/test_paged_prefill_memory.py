"""A prompt chunk's attention over a long context (kvtier.paged.reference._flash_lower_right,
the CUDA path of `split` and `reference`), run here on CPU tensors: its results equal one SDPA
call over every head's repeated K/V, and the bytes it holds at once stay within the GPU memory
plan's term for it (`prefill_attention_bytes`, part of the activations). Repeating every head's
K/V at once, as the path did before, held 348 MB for Qwen2-7B at 24K tokens beside a profile
of 142.5 MiB, and two returning turns went out of memory on an H100."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from device_ledger import DeviceLedger
from torch.nn.attention.bias import causal_lower_right

from kvtier.geometry import KVGeometry
from kvtier.paged.reference import (
    FLASH_KV_BYTES,
    _flash_lower_right,
    flash_heads,
    prefill_attention_bytes,
)
from kvtier.server.devices.memplan import (
    activation_estimate,
    attention_estimate,
    offline_plan,
)

MiB = 2**20
QWEN2_7B = Path(__file__).resolve().parents[2] / "configs" / "models" / "qwen2-7b" / "config.json"


def _pool(
    pages: int, page: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (pages, page, kv_heads, dim)
    return (
        torch.randn(shape, generator=gen).to(dtype),
        torch.randn(shape, generator=gen).to(dtype),
    )


def _pages(n_k: int, page: int, pool_pages: int, seed: int) -> torch.Tensor:
    """A shuffled page table for `n_k` tokens (int32, as the block table holds it)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(pool_pages, generator=gen)[: -(-n_k // page)].to(torch.int32)


def _all_heads_at_once(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    n_k: int,
    scale: float,
) -> torch.Tensor:
    """The unchunked math: every head's K/V gathered and repeated, one SDPA call."""
    group = q.shape[1] // k_cache.shape[2]
    k = k_cache.index_select(0, pages).flatten(0, 1)[:n_k].transpose(0, 1).to(q.dtype)
    v = v_cache.index_select(0, pages).flatten(0, 1)[:n_k].transpose(0, 1).to(q.dtype)
    kk, vv = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        kk[None],
        vv[None],
        attn_mask=causal_lower_right(q.shape[0], n_k),
        scale=scale,
    )
    return o[0].transpose(0, 1)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "n_q", "n_k"),
    [(8, 2, 5, 5), (8, 2, 17, 300), (12, 4, 40, 777), (6, 6, 9, 130), (7, 1, 33, 1000)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_in_groups_equal_one_call_over_all_heads(
    heads: int, kv_heads: int, n_q: int, n_k: int, dtype: torch.dtype
) -> None:
    page, dim, scale = 16, 32, 0.125
    k_cache, v_cache = _pool(80, page, kv_heads, dim, dtype)
    pages = _pages(n_k, page, 80, seed=n_k)
    q = torch.randn(n_q, heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = _all_heads_at_once(q, k_cache, v_cache, pages, n_k, scale)
    span = pages.numel() * page
    one_head = 2 * span * dim * q.element_size()
    # one head a call, a group and a half, a group across two KV heads, all heads at once
    for budget in (one_head, 3 * one_head, (heads // kv_heads + 1) * one_head, FLASH_KV_BYTES):
        got = _flash_lower_right(q, k_cache, v_cache, pages, n_k, scale, budget)
        assert got.shape == (n_q, heads, dim) and got.dtype == dtype
        assert torch.equal(got, want), (budget, (got.float() - want.float()).abs().max())
    assert flash_heads(span, heads, dim, q.element_size(), one_head) == 1


def test_a_pool_of_another_dtype_is_cast_on_the_copy() -> None:
    k_cache, v_cache = _pool(40, 16, 2, 32, torch.float32)
    pages = _pages(500, 16, 40, seed=3)
    q = torch.randn(24, 8, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = _all_heads_at_once(q, k_cache, v_cache, pages, 500, 0.2)
    got = _flash_lower_right(q, k_cache, v_cache, pages, 500, 0.2, 2 * 512 * 32 * 2)
    assert torch.equal(got, want)


def test_a_long_prefill_row_stays_within_the_plans_term() -> None:
    """One prompt chunk over a long context, Qwen2-7B's head layout (28 query heads, 4 KV heads
    of 128) in float32 at a smaller context and copy budget: the live bytes the attention makes
    stay within `prefill_attention_bytes`, which is far below the whole repeat at once (what
    the path held before). The ledger sees every tensor the path returns from a torch call;
    the CPU's SDPA materializes a mask besides, which the CUDA flash kernel does not."""
    heads, kv_heads, dim, page, n_q, n_k = 28, 4, 128, 16, 64, 3000
    budget = 8 * MiB  # 2 * 3008 * 128 * 4 B = 2.9 MiB a head: 2 heads a call, 14 calls
    k_cache, v_cache = _pool(-(-n_k // page) + 8, page, kv_heads, dim, torch.float32)
    pages = _pages(n_k, page, k_cache.shape[0], seed=5)
    q = torch.randn(n_q, heads, dim, generator=torch.Generator().manual_seed(4))
    term = prefill_attention_bytes(
        context_tokens=n_k,
        query_tokens=n_q,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=dim,
        element=4,
        page_size=page,
        budget=budget,
    )
    ledger = DeviceLedger("cpu")
    with ledger:
        out = _flash_lower_right(q, k_cache, v_cache, pages, n_k, 0.1, budget)
    del out
    whole_repeat = 2 * n_k * heads * dim * 4  # every head's K/V repeated at once
    top = ", ".join(f"{b >> 10} KiB {op}" for b, op, _ in ledger.largest)
    assert 0 < ledger.peak <= term, f"held {ledger.peak} B, the plan's term {term} B; {top}"
    assert term < whole_repeat / 4
    # the same row with every head's copies in one call: what the plan's term would not cover
    ledger = DeviceLedger("cpu")
    with ledger:
        out = _flash_lower_right(q, k_cache, v_cache, pages, n_k, 0.1, 1 << 40)
    del out
    assert ledger.peak > term


def test_the_plans_activations_count_a_full_context_prefill_row() -> None:
    config = json.loads(QWEN2_7B.read_text())
    g = KVGeometry.from_config(config)
    plan = offline_plan(config, g, 24 << 30, 0.9, 64, 1024, 512, 256, context_tokens=32768)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    profiled = max(
        activation_estimate(hidden, inter, vocab, 1024, 64, 2),
        activation_estimate(hidden, inter, vocab, 512, 512, 2),
    )
    term = attention_estimate(g, 28, 32768, 1024)
    assert plan.activations == profiled + term
    # Qwen2-7B, bf16, 32K tokens: 8 query heads a call (2 * 8 * 32768 * 128 * 2 B = 128 MiB),
    # the 1,024-token chunk's result (7 MiB), one call's output and log-sum-exp (2.03 MiB)
    assert flash_heads(32768, 28, 128, 2, FLASH_KV_BYTES) == 8
    assert term == 1024 * 28 * 128 * 2 + 2 * 8 * 32768 * 128 * 2 + 8 * 1024 * (128 * 2 + 4)
    assert round(term / MiB, 1) == 137.0
    short = offline_plan(config, g, 24 << 30, 0.9, 64, 1024, 512, 256, context_tokens=16384)
    assert short.activations - profiled == attention_estimate(g, 28, 16384, 1024)
    # the copies stay within FLASH_KV_BYTES at any context until one head's alone is more:
    # past 262,144 tokens (head dim 128, bf16) the term grows with the context
    result_and_output = 1024 * 28 * 256 + 1024 * 260
    assert attention_estimate(g, 28, 131072, 1024) <= FLASH_KV_BYTES + 2 * result_and_output
    assert attention_estimate(g, 28, 1 << 20, 1024) == result_and_output + 2 * (1 << 20) * 256
