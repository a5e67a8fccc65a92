"""Session lifecycle, write policies, L1 admission and the cost model inside the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

from kvtier import CacheConfig, TieredCache
from kvtier.errors import ConfigError, L1BudgetExceeded, SessionError
from kvtier.integrations.hf import cache_kwarg

CHUNK = 16


def cfg(root: Path, **kw) -> CacheConfig:
    base = dict(
        l3_root=root,
        l1_bytes=8 << 20,
        l2_bytes=4 << 20,
        chunk_tokens=CHUNK,
        cost_model=False,
        pin_memory=False,
    )
    base.update(kw)
    return CacheConfig(**base)


def turn(model, cache, sid, ids, tenant="t"):
    s = cache.session(sid, tenant=tenant)
    pkv = s.restore(ids)
    with torch.no_grad():
        model(ids[:, pkv.get_seq_length() :], **{cache_kwarg(model): pkv})
    s.commit(ids)
    return s


def ids_of(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (1, n), generator=g)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_bad_config_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="write_policy"):
        cfg(tmp_path, write_policy="sometimes")
    with pytest.raises(ConfigError, match="chunk_tokens"):
        cfg(tmp_path, chunk_tokens=10)
    with pytest.raises(ConfigError, match="codec"):
        cfg(tmp_path, codec="zip")


@pytest.mark.parametrize(
    ("policy", "written_at_commit"),
    [("write_through", 4), ("write_back", 0), ("write_through_selective", 0)],
)
def test_write_policies(tmp_path: Path, model, policy: str, written_at_commit: int) -> None:
    cache = TieredCache(cfg(tmp_path, write_policy=policy), model)
    turn(model, cache, "a", ids_of(4 * CHUNK + 3))
    cache.flush()
    assert cache.stats().tier("l2").chunks == written_at_commit
    cache.close()


def test_selective_writes_chunks_seen_twice(tmp_path: Path, model) -> None:
    cache = TieredCache(cfg(tmp_path, write_policy="write_through_selective"), model)
    prompt = ids_of(2 * CHUNK + 1)
    turn(model, cache, "a", prompt)
    assert cache.stats().tier("l2").chunks == 0
    turn(model, cache, "b", prompt)  # the same prefix seen a second time: now worth storing
    assert cache.stats().tier("l2").chunks == 2
    cache.close()


def test_write_back_loses_nothing_on_eviction(tmp_path: Path, model) -> None:
    cache = TieredCache(cfg(tmp_path, write_policy="write_back"), model)
    ids = ids_of(3 * CHUNK + 5)
    s = turn(model, cache, "a", ids)
    s.hibernate()
    snap = cache.stats()
    assert snap.tier("l3").chunks == 4  # 3 full chunks + the 5-token tail
    pkv = cache.session("a", tenant="t").restore(torch.cat([ids, ids_of(2, 9)], 1))
    assert pkv.get_seq_length() == ids.shape[1]
    cache.close()


def test_stored_counters_split_out_partial_tails(tmp_path: Path, model) -> None:
    cache = TieredCache(cfg(tmp_path, write_policy="write_back"), model)
    ids = ids_of(3 * CHUNK + 5)
    turn(model, cache, "a", ids).hibernate()  # 3 full chunks and a 5-token tail
    stored = cache.counters.copy().stored
    assert stored == {"chunks": 4, "tokens": 3 * CHUNK + 5, "tails": 1, "tail_tokens": 5}
    cache.session("a", tenant="t").hibernate()  # stored already: nothing written again
    assert cache.counters.copy().stored == stored
    cache.close()


def test_l1_budget_evicts_idle_sessions_lru(tmp_path: Path, model) -> None:
    # 512 bytes/token; 8 MiB would hold 16384 tokens -> budget for about 3 sessions of 2000
    cache = TieredCache(cfg(tmp_path, l1_bytes=3 * 2048 * 512, l2_bytes=32 << 20), model)
    for i in range(6):
        turn(model, cache, f"s{i}", ids_of(2000, i))
        assert cache.l1.used_bytes <= cache.l1.budget_bytes
    snap = cache.stats()
    states = dict(snap.sessions_by_state)
    assert states["idle"] == 3 and states["hibernated"] == 3
    assert snap.tier("l1").evictions == 3
    resident = {s.session_id for s in cache.sessions() if s.resident}
    assert resident == {"s3", "s4", "s5"}  # least recently used went first
    cache.close()


def test_pinned_sessions_are_evicted_last(tmp_path: Path, model) -> None:
    cache = TieredCache(cfg(tmp_path, l1_bytes=2 * 2048 * 512, l2_bytes=32 << 20), model)
    turn(model, cache, "pinned", ids_of(2000, 1)).pin()
    turn(model, cache, "b", ids_of(2000, 2))
    turn(model, cache, "c", ids_of(2000, 3))
    assert cache.session("pinned", tenant="t").resident
    assert not cache.session("b", tenant="t").resident
    cache.close()


def test_request_larger_than_l1_is_a_clear_error(tmp_path: Path, model) -> None:
    cache = TieredCache(cfg(tmp_path, l1_bytes=CHUNK * 512 * 4), model)
    s = cache.session("big", tenant="t")
    with pytest.raises(L1BudgetExceeded, match="l1_bytes"):
        s.restore(ids_of(10 * CHUNK))
    # the cache keeps working for requests that fit
    turn(model, cache, "small", ids_of(CHUNK))
    cache.close()


def test_session_misuse_is_typed(tmp_path: Path, model) -> None:
    cache = TieredCache(cfg(tmp_path), model)
    s = cache.session("x", tenant="t")
    with pytest.raises(SessionError):
        s.commit(ids_of(5))  # commit before restore
    s.restore(ids_of(5))
    with pytest.raises(SessionError):
        s.restore(ids_of(5))  # a second request while the first runs
    with pytest.raises(SessionError):
        s.hibernate()
    s.abort()
    s.hibernate()
    with pytest.raises(SessionError):
        cache.session("", tenant="t")
    cache.close()
    cache.close()  # idempotent


def test_prefetch_brings_l3_chunks_into_l2(tmp_path: Path, model) -> None:
    cache = TieredCache(cfg(tmp_path), model)
    ids = ids_of(4 * CHUNK + 2)
    turn(model, cache, "p", ids).hibernate()
    cache.evict_l2()
    assert cache.stats().tier("l2").chunks == 0
    s = cache.session("p", tenant="t")
    s.prefetch()
    pkv = s.restore(torch.cat([ids, ids_of(1, 3)], 1))
    assert s.restore_source == "l2"
    assert pkv.get_seq_length() == ids.shape[1]
    cache.close()


def test_ttl_closes_idle_sessions(tmp_path: Path, model) -> None:
    cache = TieredCache(cfg(tmp_path), model)
    s = turn(model, cache, "short-lived", ids_of(20))
    s.ttl(0.0)
    turn(model, cache, "other", ids_of(20, 1))  # any cache call reaps expired sessions
    assert "short-lived" not in {x.session_id for x in cache.sessions()}
    cache.close()


def test_restart_finds_hibernated_sessions(tmp_path: Path, model) -> None:
    cache = TieredCache(cfg(tmp_path), model)
    for i in range(3):
        turn(model, cache, f"h{i}", ids_of(40 + i, i)).hibernate()
    cache.close()
    again = TieredCache(cfg(tmp_path), model)
    found = {s.session_id: s for s in again.sessions()}
    assert set(found) == {"h0", "h1", "h2"}
    assert all(s.state.value == "hibernated" for s in found.values())
    assert [len(found[f"h{i}"].tokens) for i in range(3)] == [40, 41, 42]
    again.close()


def test_throttled_l3_makes_the_cost_model_recompute(tmp_path: Path, model) -> None:
    """With L3 throttled to 50 KB/s, loading 8 KB chunks costs more than prefill: recompute."""
    ids = ids_of(8 * CHUNK + 1)
    for limit, expect in ((None, "l3"), (50_000.0, "recompute")):
        root = tmp_path / str(limit)
        cache = TieredCache(
            cfg(
                root,
                cost_model=True,
                l3_read_bytes_per_s=limit,
                initial_bandwidth={"l1": 1e11, "l2": 1e10, "l3": 1e8},
            ),
            model,
        )
        turn(model, cache, "w", ids).hibernate()
        cache.evict_l2()
        s = cache.session("w", tenant="t")
        pkv = s.restore(torch.cat([ids, ids_of(1, 5)], 1))
        with torch.no_grad():
            model(
                torch.cat([ids, ids_of(1, 5)], 1)[:, pkv.get_seq_length() :],
                **{cache_kwarg(model): pkv},
            )
        s.commit(torch.cat([ids, ids_of(1, 5)], 1))
        if limit is None:
            assert s.restore_source == "l3"
        else:
            # each restore measures the throttled disk; one sample moves the estimate at most
            # 4 x, so within a few restores the cache has learned and recomputes from then on
            sources = []
            for n in range(2, 14):
                s.hibernate()
                cache.evict_l2()
                s = cache.session("w", tenant="t")
                s.restore(torch.cat([ids, ids_of(n, 5)], 1))
                sources.append(s.restore_source)
                s.abort()
            first = sources.index(expect)
            assert first <= 8 and set(sources[first:]) == {expect}, sources
        decisions = dict(cache.stats().restore_decisions)
        assert sum(decisions.values()) >= 2
        cache.close()


def test_published_prefix_is_shared_across_tenants(tmp_path: Path, model) -> None:
    system = ids_of(4 * CHUNK, 11)
    cache = TieredCache(cfg(tmp_path), model)
    a = turn(model, cache, "a", torch.cat([system, ids_of(3, 1)], 1), tenant="acme")
    assert cache.publish_shared(system, a) == 4
    b = cache.session("b", tenant="globex")
    pkv = b.restore(torch.cat([system, ids_of(3, 2)], 1))
    assert pkv.get_seq_length() == 4 * CHUNK and b.restore_source == "l2"
    b.abort()
    # an unpublished prefix of tenant acme stays private
    private = ids_of(3 * CHUNK, 12)
    turn(model, cache, "a2", torch.cat([private, ids_of(2, 3)], 1), tenant="acme")
    c = cache.session("c", tenant="globex")
    assert c.restore(torch.cat([private, ids_of(2, 4)], 1)).get_seq_length() == 0
    c.abort()
    cache.close()


@pytest.mark.parametrize("writer", ["process", "threads", "auto"])
def test_l3_writer_modes_store_the_same_chunks(tmp_path: Path, model, writer: str) -> None:
    cache = TieredCache(cfg(tmp_path, l3_writer=writer), model)
    effective = "threads" if writer == "auto" else writer  # auto: threads for a CPU model
    assert cache.engine.l3_writer == effective
    assert cache.l2.shared == (effective == "process")
    turn(model, cache, "a", ids_of(3 * CHUNK + 5))
    cache.flush()
    assert cache.stats().tier("l3").chunks == 3  # type: ignore[union-attr]  # written through
    cache.close()


def test_writer_process_unavailable_falls_back_to_threads(
    tmp_path: Path, model, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import kvtier.transfer

    def no_child(*args, **kw):  # type: ignore[no-untyped-def]
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(kvtier.transfer, "WriterProcess", no_child)
    cache = TieredCache(cfg(tmp_path, l3_writer="process"), model)
    assert cache.engine._proc is None and not cache.l2.shared
    assert "writing L3 from threads" in caplog.text
    turn(model, cache, "a", ids_of(2 * CHUNK))
    cache.flush()
    assert cache.stats().tier("l3").chunks == 2  # type: ignore[union-attr]
    cache.close()


def _common_prefix_loop(a: list[int], b: list[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def test_common_prefix_equals_the_element_by_element_count() -> None:
    """What a session's stored tokens and a prompt share decides what is restored: the C-speed
    version (one comparison, bisection on a mismatch) agrees with counting token by token."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvtier.cache.restore import common_prefix

    tokens = st.lists(st.integers(0, 3), max_size=300)  # few values: long shared runs

    @settings(max_examples=400, deadline=None)
    @given(a=tokens, b=tokens, shared=st.lists(st.integers(0, 3), max_size=300))
    def check(a: list[int], b: list[int], shared: list[int]) -> None:
        x, y = shared + a, shared + b
        assert common_prefix(x, y) == _common_prefix_loop(x, y) == common_prefix(y, x)
        # a session's tokens are a tuple, a caller's prompt may be a list
        assert common_prefix(tuple(x), y) == common_prefix(x, tuple(y)) == common_prefix(x, y)

    check()
    assert common_prefix([], [1]) == 0 and common_prefix([5, 6], [5, 6, 7]) == 2


def test_token_ids_are_ints_in_a_tuple_and_anything_else_is_a_type_error() -> None:
    import numpy as np

    from kvtier.cache.session import as_ids

    assert as_ids([3, 4, 5]) == (3, 4, 5)
    assert as_ids(torch.tensor([[3, 4, 5]])) == (3, 4, 5)
    for odd in (np.array([3, 4, 5]), [np.int64(3), 4, np.int32(5)]):
        ids = as_ids(odd)
        assert ids[:2] == (3, 4) and {type(x) for x in ids} == {int}, ids
    for bad in ([1, 2.0], ["1"], [3, True], torch.tensor([1.0, 2.0]), torch.tensor([True])):
        with pytest.raises(TypeError, match="token ids must be integers"):
            as_ids(bad)
    with pytest.raises(ValueError, match="one sequence"):
        as_ids(torch.zeros(2, 3, dtype=torch.long))


def test_stored_token_ids_are_out_of_the_collectors_walk(tmp_path: Path, model) -> None:
    """A session keeps its token ids as a tuple of ints, which the cyclic collector untracks at
    its first collection: it never walks a session's ids again, however many sessions there are.
    (A list stays tracked, and every collection that reaches it visits each id.)"""
    import gc

    cache = TieredCache(cfg(tmp_path), model)
    s = turn(model, cache, "a", ids_of(40))
    s2 = turn(model, cache, "b", ids_of(40, seed=1))
    s2.hibernate()
    cache.close()
    cache = TieredCache(cfg(tmp_path), model)  # "b" again, from L3's record
    returning = cache.session("b", tenant="t")
    gc.collect()
    for sess in (s, returning):
        assert len(sess.tokens) >= 32 and not gc.is_tracked(sess.tokens), type(sess.tokens)
    cache.close()


def test_layer_views_follow_the_buffers_and_are_read_only(tmp_path: Path, model) -> None:
    """A restored Cache's `keys`/`values` are made when read: after the forward, an append
    (`extend`) and a crop they cover exactly the filled tokens, and they are the L1 buffers'
    own memory; assigning them is refused (K/V goes in through update())."""
    from kvtier.integrations.hf import KvtierCache

    cache = TieredCache(cfg(tmp_path), model)
    ids = ids_of(40)
    s = cache.session("v", tenant="t")
    kv = s.restore(ids)
    assert isinstance(kv, KvtierCache)
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): kv})
    layer = kv.layers[1]
    k, v = layer.keys, layer.values
    assert k.shape[-2] == v.shape[-2] == 40
    assert k.data_ptr() == s.bufs.layers[1][0].data_ptr()  # a view, not a copy
    new = torch.randn(len(kv.layers), 2, 1, k.shape[1], 3, k.shape[-1])
    kv.extend(new)
    assert layer.keys.shape[-2] == 43 and torch.equal(layer.values[0, :, 40:], new[1, 1, 0])
    layer.crop(41)
    assert layer.keys.shape[-2] == 41
    with pytest.raises(AttributeError, match="update"):
        layer.keys = torch.zeros(1)
    s.abort()
    cache.close()
