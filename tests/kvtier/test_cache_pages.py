"""`Session.restore(ids, pool=pool)`: the session's K/V lives in pages of a caller's page pool,
and the Cache is a view over them (kvtier.cache.pages, kvtier.integrations.paged_cache).

Tiny transformers models on the CPU in float32, greedy: every turn must give the tokens and
logits of a full recompute, whether its prefix stayed in the pages, came back from L2 (a
staged restore: L2 slots straight into pages) or from L3 after a restart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import MODELS
from test_cache_exact import TURNS, config, greedy, reference

from kvtier import TieredCache
from kvtier.errors import ConfigError, SessionError
from kvtier.geometry import KVGeometry
from kvtier.integrations.hf import cache_kwarg
from kvtier.integrations.paged_cache import PagedCache
from kvtier.paged import PagePool, PoolExhausted
from kvtier.types import SessionState


def _pool(model, pages: int = 512, **kw) -> PagePool:
    g = KVGeometry.from_config(model.config)
    page_bytes = g.bytes_per_token * 4
    kw.setdefault("dtype", torch.float32)
    return PagePool(g, pages * page_bytes, page_size=4, **kw)


def _turn(model, cache: TieredCache, pool: PagePool, sid: str, ids: torch.Tensor):
    """One greedy turn through the pool; checks it against a full recompute."""
    s = cache.session(sid, tenant="t")
    pkv = s.restore(ids, pool=pool)
    assert isinstance(pkv, PagedCache) and pkv.pool is pool
    restored = pkv.get_seq_length()
    seq, scores = greedy(model, ids, pkv)
    s.commit(seq)
    ref_seq, ref_scores = reference(model, ids)
    assert torch.equal(seq, ref_seq), "tokens differ from a full recompute"
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)
    assert s.state is SessionState.IDLE and s.in_pages and not s.resident
    return seq, s.restore_source, restored


def _pins(cache: TieredCache) -> int:
    return sum(e.pins for e in cache.directory.entries.values())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_turns_stay_in_the_pages_and_come_back_from_l2_and_l3(tmp_path: Path, name: str) -> None:
    model = MODELS[name]()
    pool = _pool(model)
    cache = TieredCache(config(tmp_path), model)
    ids = torch.tensor([[1]], dtype=torch.long)
    sources = []
    for turn, new in enumerate(TURNS[:3]):
        ids = torch.cat([ids, torch.tensor([new])], dim=1)
        ids, source, restored = _turn(model, cache, pool, "a", ids)
        sources.append(source)
        assert cache.l1.used_bytes == 0  # no L1 buffer, ever
        held = pool.num_pages - pool.num_free
        assert held == pool.pages_for(ids.shape[1] - 1)  # the session's K/V, in pages
        if turn == 1:
            cache.session("a", tenant="t").hibernate()  # the pages go back; L2/L3 keep it
            assert pool.num_free == pool.num_pages
    assert sources == ["recompute", "l1", "l2"]
    assert _pins(cache) == 0  # the staged prefix was let go
    cache.close()
    assert pool.num_free == pool.num_pages
    # a new process over the same L3: the next turn lands in the pages from disk
    cache = TieredCache(config(tmp_path), model)
    ids = torch.cat([ids, torch.tensor([TURNS[3]])], dim=1)
    _, source, restored = _turn(model, cache, pool, "a", ids)
    assert source == "l3" and restored > 0
    cache.close()


def test_a_full_pool_takes_the_least_recently_active_sessions_pages(tmp_path: Path) -> None:
    model = MODELS["qwen2"]()
    pool = _pool(model, pages=20)  # 80 tokens: one conversation at a time
    cache = TieredCache(config(tmp_path), model)
    ids = {sid: torch.tensor([[1, *TURNS[0]]], dtype=torch.long) for sid in "ab"}
    ids["a"], _, _ = _turn(model, cache, pool, "a", ids["a"])
    ids["b"], _, _ = _turn(model, cache, pool, "b", ids["b"])
    a, b = cache.session("a", tenant="t"), cache.session("b", tenant="t")
    assert a.state is SessionState.HIBERNATED and a.pages is None  # its pages went to b
    assert b.pages is not None and b.state is SessionState.IDLE
    assert cache.stats().tier("l1").evictions >= 1  # type: ignore[union-attr]
    ids["a"] = torch.cat([ids["a"], torch.tensor([TURNS[1]])], dim=1)
    _, source, _ = _turn(model, cache, pool, "a", ids["a"])
    assert source == "l2"  # exact from its stored chunks
    cache.close()


def test_an_aborted_turn_gives_its_pages_back_and_keeps_the_stored_prefix(tmp_path: Path) -> None:
    """Its partial last chunk included: the turn started from the pages, and its stored tail
    is still the session's after the abort."""
    model = MODELS["llama"]()
    pool = _pool(model)
    cache = TieredCache(config(tmp_path), model)
    ids = torch.tensor([[1, *TURNS[2]]], dtype=torch.long)
    ids, _, _ = _turn(model, cache, pool, "a", ids)
    assert (ids.shape[1] - 1) % 16  # the K/V ends inside a chunk
    s = cache.session("a", tenant="t")
    pkv = s.restore(torch.cat([ids, torch.tensor([TURNS[1]])], dim=1), pool=pool)
    model(torch.tensor([TURNS[1]]), **{cache_kwarg(model): pkv})  # a half-done turn ...
    s.abort()  # ... that failed
    assert s.state is SessionState.HIBERNATED and pool.num_free == pool.num_pages
    _, source, restored = _turn(
        model, cache, pool, "a", torch.cat([ids, torch.tensor([TURNS[2]])], dim=1)
    )
    assert source == "l2" and restored == ids.shape[1] - 1
    cache.close()


def test_a_pool_that_cannot_hold_the_turn_fails_it_and_loses_nothing(tmp_path: Path) -> None:
    model = MODELS["llama"]()
    cache = TieredCache(config(tmp_path), model)
    ids = torch.tensor([[1, *TURNS[0]]], dtype=torch.long)
    ids, _, _ = _turn(model, cache, _pool(model), "a", ids)
    cache.session("a", tenant="t").hibernate()
    tiny = _pool(model, pages=2)  # 8 tokens
    s = cache.session("a", tenant="t")
    with pytest.raises(PoolExhausted, match="larger byte budget"):
        s.restore(ids, pool=tiny)
    assert s.state is SessionState.HIBERNATED and tiny.num_free == tiny.num_pages
    assert _pins(cache) == 0
    _, source, _ = _turn(model, cache, _pool(model), "a", torch.cat([ids, torch.tensor([[3]])], 1))
    assert source == "l2"
    cache.close()


def test_bad_pools_and_codecs_are_refused_with_what_to_do(tmp_path: Path) -> None:
    model = MODELS["llama"]()
    cache = TieredCache(config(tmp_path), model)
    s = cache.session("a", tenant="t")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ConfigError, match="kv_dtype='native'"):
        s.restore(ids, pool=_pool(model, kv_dtype="int8"))
    other = KVGeometry.from_config(MODELS["qwen2"]().config)
    with pytest.raises(ConfigError, match="from_config"):
        s.restore(ids, pool=PagePool(other, 1 << 20, page_size=4, dtype=torch.float32))
    with pytest.raises(ConfigError, match="dtype="):
        s.restore(ids, pool=_pool(model, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match="PagePool"):
        s.restore(ids, pool=object())  # type: ignore[call-overload]
    assert s.state is not SessionState.ACTIVE
    cache.close()
    cache = TieredCache(config(tmp_path / "int8", codec="int8"), model)
    with pytest.raises(ConfigError, match="codec='native'"):
        cache.session("a", tenant="t").restore(ids, pool=_pool(model))
    cache.close()


def test_a_second_restore_of_a_running_session_is_refused(tmp_path: Path) -> None:
    model = MODELS["llama"]()
    pool = _pool(model)
    cache = TieredCache(config(tmp_path), model)
    s = cache.session("a", tenant="t")
    s.restore(torch.tensor([[1, 2, 3]]), pool=pool)
    with pytest.raises(SessionError, match="served in order"):
        s.restore(torch.tensor([[1, 2, 3]]), pool=pool)
    s.abort()
    cache.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pages_through_l2_and_back_are_bit_identical(tmp_path: Path) -> None:
    """bfloat16 on the GPU, pinned L2: the K/V a turn computed into its pages, stored at the
    commit and landed in new pages by a staged restore, is the same bit for bit; and a
    restored turn's greedy tokens are those of the same turn from the kept pages."""
    model = MODELS["llama"]().to("cuda", torch.bfloat16)
    g = KVGeometry.from_config(model.config)
    pool = PagePool(g, 4096 * g.bytes_per_token, page_size=16, device="cuda", dtype=torch.bfloat16)
    cache = TieredCache(config(tmp_path, pin_memory=True, l1_bytes=16 << 20), model)
    s = cache.session("a", tenant="t")
    ids = torch.randint(1, 200, (1, 300), device="cuda")
    pkv = s.restore(ids, pool=pool)
    seq = model.generate(ids, **{cache_kwarg(model): pkv}, max_new_tokens=8, do_sample=False)
    s.commit(seq)
    n = seq.shape[1] - 1
    before = pool.gather(s.pages.table.pages, 0, n).clone()  # type: ignore[union-attr]
    nxt = torch.cat([seq, torch.tensor([[7, 8, 9]], device="cuda")], dim=1)
    kept = s.restore(nxt, pool=pool)
    assert s.restore_source == "l1"
    from_pages = model.generate(
        nxt, **{cache_kwarg(model): kept}, max_new_tokens=8, do_sample=False
    )
    s.abort()  # the pages go; the stored prefix stays
    restored = s.restore(nxt, pool=pool)
    assert s.restore_source == "l2" and restored.get_seq_length() == n
    after = pool.gather(restored.table.pages, 0, n)
    assert after.dtype == torch.bfloat16 and torch.equal(after, before)
    from_l2 = model.generate(
        nxt, **{cache_kwarg(model): restored}, max_new_tokens=8, do_sample=False
    )
    assert torch.equal(from_l2, from_pages)
    s.abort()
    cache.close()
