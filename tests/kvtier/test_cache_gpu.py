"""The exactness and eviction paths on a CUDA device (run on a GPU machine; skipped elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from test_cache_exact import greedy
from transformers import DynamicCache

from kvtier import CacheConfig, TieredCache
from kvtier.errors import BudgetError
from kvtier.integrations.hf import cache_kwarg

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TURNS = [[5, 9, 13] * 90, [7, 3] * 40, [11] * 70]


@pytest.mark.parametrize("evict", ["none", "l2", "l3"])
def test_cuda_turns_match_recompute(tmp_path: Path, evict: str) -> None:
    model = tiny_llama().cuda()
    cache = TieredCache(
        CacheConfig(
            l3_root=tmp_path,
            l1_bytes=256 << 20,
            l2_bytes=64 << 20,
            chunk_tokens=64,
            cost_model=False,
        ),
        model,
    )
    ids = torch.tensor([[1]], device="cuda")
    for turn, new in enumerate(TURNS):
        ids = torch.cat([ids, torch.tensor([new], device="cuda")], dim=1)
        s = cache.session("g", tenant="t")
        seq, scores = greedy(model, ids, s.restore(ids), steps=8)
        s.commit(seq)
        if turn:
            assert s.restore_source == {"none": "l1", "l2": "l2", "l3": "l3"}[evict]
        ref_seq, ref_scores = greedy(model, ids, DynamicCache(), steps=8)
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=0)
        ids = seq
        if evict != "none":
            s.hibernate()
        if evict == "l3":
            cache.evict_l2()
    snap = cache.stats()
    assert snap.checksum_failures == 0
    assert cache.l1.reserved_bytes() >= cache.l1.used_bytes
    cache.close()


def test_cuda_l1_budget_and_oom_safety(tmp_path: Path) -> None:
    model = tiny_llama().cuda()
    per_session = 2048 * 512  # tokens x bytes/token of the tiny model (fp32)
    cache = TieredCache(
        CacheConfig(l3_root=tmp_path, l1_bytes=4 * per_session, l2_bytes=64 << 20, chunk_tokens=64),
        model,
    )
    staging = cache.engine.staging_bytes  # comes out of l1_bytes; the rest is claimed at start
    assert cache.l1.budget_bytes == 4 * per_session - staging
    claimed = cache.l1.reserved_bytes()
    assert claimed >= cache.l1.budget_bytes
    for i in range(12):
        # > 1 MiB per session: the allocator's large blocks, carved from the claimed segment
        # (blocks up to 1 MiB come from small 2 MiB segments of their own)
        ids = torch.randint(1, 250, (1, 2100), device="cuda")
        s = cache.session(f"s{i}", tenant="t")
        pkv = s.restore(ids)
        with torch.no_grad():
            model(ids[:, pkv.get_seq_length() :], **{cache_kwarg(model): pkv})
        s.commit(ids)
        assert cache.l1.used_bytes <= cache.l1.budget_bytes
    assert cache.stats().tier("l1").evictions >= 8
    assert cache.l1.reserved_bytes() == claimed  # every session fit in the claimed segment
    cache.close()


def test_cuda_l1_budget_larger_than_the_gpu_fails_at_start(tmp_path: Path) -> None:
    model = tiny_llama().cuda()
    _free, total = torch.cuda.mem_get_info()
    with pytest.raises(BudgetError, match="lower l1_bytes"):
        TieredCache(
            CacheConfig(l3_root=tmp_path, l1_bytes=2 * total, l2_bytes=64 << 20, chunk_tokens=64),
            model,
        )
