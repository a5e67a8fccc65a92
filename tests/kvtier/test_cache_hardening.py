"""The cache is never wrong, never forgets, never stalls: regressions of the cache core."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from test_cache_lifecycle import cfg as lifecycle_cfg

import kvtier.cache.core as core
import kvtier.cache.finder as finder
import kvtier.cache.tierset as tierset
from kvtier import CacheConfig, TieredCache
from kvtier.cache.keys import SHARED_TENANT
from kvtier.errors import ConfigError, SessionError
from kvtier.integrations.hf import cache_kwarg

CHUNK = 16


def cfg(root: Path, **kw) -> CacheConfig:
    """test_cache_lifecycle's small cache, with L3 writes from threads unless a test says."""
    kw.setdefault("l3_writer", "threads")
    return lifecycle_cfg(root, **kw)


def ids_of(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (1, n), generator=g)


def turn(model, cache, sid, ids, tenant="t"):
    s = cache.session(sid, tenant=tenant)
    pkv = s.restore(ids)
    with torch.no_grad():
        model(ids[:, pkv.get_seq_length() :], **{cache_kwarg(model): pkv})
    s.commit(ids)
    return s


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


# -- 2: the lock is never held across I/O ----------------------------------------------------


def test_l1_restore_and_stats_do_not_wait_for_a_throttled_l3_restore(tmp_path: Path, model):
    chunk_bytes = 2 * 2 * 2 * 16 * CHUNK * 4  # layers x (k, v) x kv heads x head dim x C x fp32
    slow = ids_of(4 * CHUNK + 1, 1)
    # the 4 chunks of `slow` take 2 s to read
    cache = TieredCache(cfg(tmp_path, l3_read_bytes_per_s=4 * chunk_bytes / 2.0), model)
    turn(model, cache, "slow", slow).hibernate()
    cache.evict_l2()
    fast = ids_of(2 * CHUNK + 3, 2)
    turn(model, cache, "fast", fast)
    done: list[float] = []

    def restore_slow() -> None:
        t0 = time.perf_counter()
        s = cache.session("slow", tenant="t")
        pkv = s.restore(torch.cat([slow, ids_of(1, 9)], 1))
        done.append(time.perf_counter() - t0)
        assert pkv.get_seq_length() == slow.shape[1] and s.restore_source == "l3"
        s.abort()

    th = threading.Thread(target=restore_slow)
    th.start()
    time.sleep(0.3)  # the slow restore is in its load phase now
    t0 = time.perf_counter()
    s = cache.session("fast", tenant="t")
    pkv = s.restore(torch.cat([fast, ids_of(1, 8)], 1))
    t_restore = time.perf_counter() - t0
    assert pkv.get_seq_length() == fast.shape[1] and s.restore_source == "l1"
    s.abort()
    t0 = time.perf_counter()
    snap = cache.stats()
    t_stats = time.perf_counter() - t0
    th.join()
    assert t_restore < 0.05, t_restore
    assert t_stats < 0.05, t_stats
    assert snap.sessions_in("active") == 1  # taken while the slow restore was loading
    assert done and done[0] > 1.5, done  # the throttle did hold the slow restore back
    cache.close()


# -- 3: L3 evictions reach the cache; a chunk that fails to read is forgotten -----------------


def test_l3_cap_never_drops_the_last_copy_of_a_live_chunk(tmp_path: Path, model):
    file_bytes = 8192 + 4096  # a chunk's .kvbin file, payload + header, rounded up
    cache = TieredCache(cfg(tmp_path, l3_max_bytes=6 * file_bytes), model)
    a = ids_of(3 * CHUNK, 1)
    turn(model, cache, "a", a)  # resident in L1; its chunks are in L2 and L3
    cache.flush()
    for i in range(4):  # the cap deletes a's chunks (no record references them yet)
        turn(model, cache, f"b{i}", ids_of(2 * CHUNK, 10 + i))
        cache.flush()
    assert cache.l3.stats().evictions >= 3
    cache.evict_l2()  # must not drop a's L2 copies: L3 no longer holds them
    s = cache.session("a", tenant="t")
    s.hibernate()
    cache.evict_l2()
    rec = cache.l3.load_session("a", "t")
    assert rec is not None and all(cache.l3.contains(k) for k in rec.chunk_keys)
    pkv = s.restore(torch.cat([a, ids_of(1, 5)], 1))
    assert pkv.get_seq_length() == 3 * CHUNK and s.restore_source == "l3"
    s.abort()
    # what the cache believes is in L3 is what L3 holds
    assert set(cache.directory.l3_tokens) <= {r.header.key for r in cache.l3.index.iter_chunks()}
    cache.close()


def test_a_chunk_that_failed_to_read_is_forgotten(tmp_path: Path, model):
    cache = TieredCache(cfg(tmp_path), model)
    ids = ids_of(3 * CHUNK, 3)
    s = turn(model, cache, "a", ids)
    s.hibernate()
    other = turn(model, cache, "b", ids)  # the same three chunks
    other.hibernate()
    cache.evict_l2()
    second = s.chunk_keys[1]
    assert cache.l3.delete(second)  # gone behind the cache's back
    assert other.info().chunks_l3 == 3
    pkv = s.restore(torch.cat([ids, ids_of(1, 4)], 1))
    assert pkv.get_seq_length() == CHUNK  # the prefix before the missing chunk
    s.abort()
    assert other.info().chunks_l3 == 2  # the cache no longer believes L3 holds it
    cache.close()


# -- 4: chunk metadata stays bounded ----------------------------------------------------------


def test_entries_stay_bounded_over_10000_sessions(tmp_path: Path, model):
    cache = TieredCache(
        cfg(tmp_path, write_policy="write_through_selective", selective_min_hits=1 << 30),
        model,
    )
    g = cache.geometry
    kv = torch.zeros(1, g.num_kv_heads, 2 * CHUNK, g.head_dim)
    live: list = []
    peak = 0
    for i in range(10_000):
        ids = torch.randint(1, 250, (1, CHUNK + 4))
        s = cache.session(f"s{i}", tenant="t")
        pkv = s.restore(ids)
        n = ids.shape[1] - pkv.get_seq_length()
        for layer in range(g.num_layers):
            pkv.update(kv[:, :, :n], kv[:, :, :n], layer)
        s.commit(ids)
        live.append(s)
        if len(live) > 20:
            live.pop(0).close()
        peak = max(peak, len(cache.directory))
    live_chunks = sum(len(s.chunk_keys) for s in live)
    assert live_chunks == 20
    assert peak <= 2 * (live_chunks + cache.l2.n_slots) + 256, peak
    for s in live:
        s.close()
    cache.stats()
    assert len(cache.directory) <= 512
    cache.close()


# -- 5: published prefixes reach L3 and survive a restart -------------------------------------


def test_published_prefix_is_served_to_another_tenant_after_restart(tmp_path: Path, model):
    system = ids_of(4 * CHUNK, 11)
    cache = TieredCache(cfg(tmp_path), model)
    a = turn(model, cache, "a", torch.cat([system, ids_of(3, 1)], 1), tenant="acme")
    assert cache.publish_shared(system, a) == 4
    cache.close()
    again = TieredCache(cfg(tmp_path), model)
    b = again.session("b", tenant="globex")
    pkv = b.restore(torch.cat([system, ids_of(3, 2)], 1))
    assert pkv.get_seq_length() == 4 * CHUNK and b.restore_source == "l3"
    b.abort()
    again.close()


def test_the_shared_tenant_name_is_reserved(tmp_path: Path, model):
    cache = TieredCache(cfg(tmp_path), model)
    with pytest.raises(SessionError, match="reserved"):
        cache.session("x", tenant=SHARED_TENANT)
    cache.close()


# -- 6: a failed constructor releases everything ----------------------------------------------


def _children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[1] == me and fields[0] != "Z":
            out.add(int(pid))
    return out


STEPS = [
    (tierset, "L1Pool"),
    (tierset, "L3Store"),
    (tierset, "HostArena"),
    (tierset, "TransferEngine"),
    (core, "CostModel"),
    (core, "make_policy"),
    (core, "ChunkDirectory"),
    (core, "SessionRecords"),
    (core, "Restorer"),
    (tierset, "claim_l1"),
    (finder.SessionFinder, "load_hibernated"),
]


@pytest.mark.parametrize("writer", ["threads", "process"])
@pytest.mark.parametrize(("where", "name"), STEPS, ids=[n for _, n in STEPS])
def test_failed_constructor_releases_everything(
    tmp_path: Path, model, monkeypatch: pytest.MonkeyPatch, where, name, writer
):
    before = _children()
    threads = threading.active_count()

    def boom(*args, **kw):  # type: ignore[no-untyped-def]
        raise RuntimeError(f"injected failure in {name}")

    with monkeypatch.context() as m:
        m.setattr(where, name, boom)
        with pytest.raises(RuntimeError, match="injected"):
            TieredCache(cfg(tmp_path, l3_writer=writer), model)
    assert _children() == before  # no L3 writer child left behind
    deadline = time.time() + 5
    while threading.active_count() > threads and time.time() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads
    TieredCache(cfg(tmp_path, l3_writer=writer), model).close()  # the root opens again


def test_every_setting_is_checked_before_anything_is_built(tmp_path: Path):
    with pytest.raises(ConfigError, match="l2_policy"):
        cfg(tmp_path / "x", l2_policy="lru2")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match="l3_max_bytes"):
        cfg(tmp_path, l3_max_bytes=0)
    with pytest.raises(ConfigError, match="l3_threads"):
        cfg(tmp_path, l3_threads=0)


# -- 12: tenants, record errors, L1 misses, chunks lost on eviction ---------------------------


def test_tenant_longer_than_the_header_holds_is_rejected(tmp_path: Path, model):
    cache = TieredCache(cfg(tmp_path), model)
    with pytest.raises(SessionError, match="64 UTF-8 bytes"):
        cache.session("x", tenant="é" * 40)  # 40 characters, 80 bytes
    s = turn(model, cache, "x", ids_of(2 * CHUNK), tenant="é" * 32)  # 64 bytes: fits
    cache.flush()
    assert s.info().chunks_l3 == 2
    cache.close()


def test_failed_record_writes_are_counted(tmp_path: Path, model, monkeypatch):
    from kvtier.errors import StoreIOError

    cache = TieredCache(cfg(tmp_path), model)
    s = turn(model, cache, "a", ids_of(2 * CHUNK))

    def fail(*args, **kw):  # type: ignore[no-untyped-def]
        raise StoreIOError("injected EIO")

    monkeypatch.setattr(cache.l3, "save_session", fail)
    monkeypatch.setattr(cache.l3, "delete_session", fail)
    s.hibernate()
    cache.session("b", tenant="t").close()
    cache.records.barrier().result()  # the record thread has run both
    assert cache.stats().record_errors == 2
    monkeypatch.undo()
    cache.close()


def test_l1_misses_are_counted(tmp_path: Path, model):
    cache = TieredCache(cfg(tmp_path), model)
    turn(model, cache, "a", ids_of(CHUNK + 2))
    turn(model, cache, "b", ids_of(CHUNK + 2, 1))
    assert cache.stats().tier("l1").misses == 2  # type: ignore[union-attr]
    turn(model, cache, "a", ids_of(CHUNK + 3))
    assert cache.stats().tier("l1").hits == 1  # type: ignore[union-attr]
    cache.close()


def test_eviction_never_lists_a_chunk_stored_nowhere(tmp_path: Path, model, monkeypatch):
    """L2 holds 2 slots, both busy with L3 writes, when a 3-chunk session is evicted: its
    record lists only chunks that are stored, and it resumes exactly from them."""
    slot = 2 * 2 * 2 * 16 * CHUNK * 4
    cache = TieredCache(cfg(tmp_path, l2_bytes=2 * slot), model)
    assert cache.l2.n_slots == 2
    gate = threading.Event()
    put = cache.l3.put

    def slow_put(*args, **kw):  # type: ignore[no-untyped-def]
        gate.wait(10)
        return put(*args, **kw)

    monkeypatch.setattr(cache.l3, "put", slow_put)
    ids = ids_of(3 * CHUNK + 5, 7)
    s = turn(model, cache, "a", ids)
    threading.Timer(0.5, gate.set).start()
    s.hibernate()
    cache.flush()
    rec = cache.l3.load_session("a", "t")
    assert rec is not None
    assert all(cache.l3.contains(k) for k in rec.chunk_keys), "a listed chunk is stored nowhere"
    cache.close()
    again = TieredCache(cfg(tmp_path), model)
    s = again.session("a", tenant="t")
    pkv = s.restore(torch.cat([ids, ids_of(1, 3)], 1))
    got = pkv.get_seq_length()
    assert got == len(rec.token_ids) // 4 and got >= CHUNK
    s.abort()
    again.close()


def test_an_unused_prefetch_does_not_hold_l2_slots(tmp_path: Path, model):
    slot = 2 * 2 * 2 * 16 * CHUNK * 4
    cache = TieredCache(cfg(tmp_path, l2_bytes=2 * slot), model)
    p = turn(model, cache, "p", ids_of(2 * CHUNK, 1))
    p.hibernate()
    cache.evict_l2()
    p.prefetch()  # both slots now hold p's chunks; nobody restores p
    time.sleep(0.2)
    q = turn(model, cache, "q", ids_of(2 * CHUNK, 2))
    cache.flush()
    assert q.info().chunks_l3 == 2  # written through L2: the prefetched slots were reusable
    cache.close()


# -- concurrency: many threads, every restored byte checked ------------------------------------


def _kv(ids: list[int], start: int, layer: int, g) -> torch.Tensor:
    """The K of tokens [start, len(ids)): a function of token id, position and layer only,
    so any correctly restored prefix holds exactly these values."""
    vals = torch.tensor([ids[p] + p / 4096 + layer for p in range(start, len(ids))])
    return vals.view(1, 1, -1, 1).expand(1, g.num_kv_heads, -1, g.head_dim).contiguous()


def test_concurrent_sessions_restore_exactly_what_was_written(tmp_path: Path, model):
    import random

    cache = TieredCache(
        cfg(tmp_path, l1_bytes=640 << 10, l2_bytes=24 * 8192, l3_read_bytes_per_s=20e6), model
    )
    g = cache.geometry
    system = [int(x) for x in ids_of(2 * CHUNK, 99)[0]]
    errors: list[BaseException] = []
    restored = [0]

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        history: dict[str, list[int]] = {}
        try:
            for _ in range(25):
                sid = f"w{tid}-{rng.randrange(3)}"
                ids = history.get(sid) or (system if rng.random() < 0.5 else [])
                if len(ids) > 160:
                    ids = system
                ids = ids + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 40))]
                s = cache.session(sid, tenant="t")
                pkv = s.restore(torch.tensor([ids]))
                n = pkv.get_seq_length()
                restored[0] += n
                for layer in range(g.num_layers):
                    k = pkv.layers[layer].keys
                    assert k is not None and torch.equal(k[:, :, :n], _kv(ids[:n], 0, layer, g))
                for layer in range(g.num_layers):
                    new = _kv(ids, n, layer, g)
                    pkv.update(new, -new, layer)
                s.commit(ids)
                history[sid] = ids
                r = rng.random()
                if r < 0.3:
                    s.hibernate()
                elif r < 0.4:
                    cache.evict_l2()
                elif r < 0.5:
                    cache.stats()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert restored[0] > 0
    assert all(e.pins == 0 for e in cache.directory.entries.values())
    snap = cache.stats()
    assert snap.tier("l1").evictions > 0  # type: ignore[union-attr]
    decisions = dict(snap.restore_decisions)
    assert decisions["l2"] + decisions["l3"] > 0  # restores from below L1 ran concurrently
    cache.close()
