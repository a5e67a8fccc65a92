"""No unbounded device memory: a commit's or an eviction's copies still in flight count inside
the cache's budget, and at the bound the commit waits (backpressure) instead of holding more.

The fleet test commits 256 sessions in a loop (restore, append K/V, commit, as the fleet
benchmark seeds its sessions) into a tiny L2 while every L3 write is slowed down: L2's few
slots are all busy with writes whenever a session leaves L1, so the eviction waits for the disk
(counted) rather than holding its K/V anywhere else or cutting it. Throughout, kvtier's device
bytes (L1 + staging + copies in flight) stay within `TieredCache.device_bytes()`, sampled after
every commit and from a thread; afterwards every session restores bit-exactly from real,
fsynced L3 files. The CPU runs the same code as the GPU but its copies finish at once, so a
second test stands in slow device copies to hold the in-flight bound to account; the GPU
variant checks torch's own allocator.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_llama
from test_cache_pages import _pool

from kvtier import CacheConfig, TieredCache
from kvtier.errors import ConfigError
from kvtier.integrations.hf import cache_kwarg
from kvtier.transfer.gatherbufs import GatherBuffers
from kvtier.transfer.inflight import Inflight

CHUNK = 16
SESSIONS = 256
MAX_TOKENS = 256  # the longest context of any test here
L3_DELAY_S = 0.004  # every L3 write sleeps this long first (then writes and fsyncs for real)


def cfg(root: Path, **kw: Any) -> CacheConfig:
    base: dict[str, Any] = dict(
        l3_root=root,
        chunk_tokens=CHUNK,
        l2_bytes=1 << 20,
        cost_model=False,  # always load the longest stored prefix: exactness is checked
        pin_memory=False,
        l3_writer="threads",
    )
    base.update(kw)
    return CacheConfig(**base)


def context(sid: int, extra: int = 0) -> list[int]:
    """Session `sid`'s tokens: three full chunks and a partial tail of 1..7 tokens."""
    g = torch.Generator().manual_seed(1000 + sid)
    n = 3 * CHUNK + 1 + sid % 7 + extra
    return [int(x) for x in torch.randint(1, 250, (n,), generator=g)]


def kv_of(cache: TieredCache, sid: int, n: int) -> torch.Tensor:
    """The K/V committed for the first `n` tokens of session `sid`: `[layer, k|v, 1,
    kv_heads, n, head_dim]`, random (seeded by the session; a token's K/V does not depend on
    `n`), so a restored byte from any other session or position differs."""
    g = cache.geometry
    gen = torch.Generator().manual_seed(sid)
    shape = (g.num_layers, 2, 1, g.num_kv_heads, MAX_TOKENS, g.head_dim)
    kv = torch.randn(shape, generator=gen).to(cache.geometry.torch_dtype())
    return kv[..., :n, :].contiguous()


def slow_l3(cache: TieredCache, monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
    """Slow every L3 write (the store's own `put`: real files, real fsync, after a sleep)."""
    put = cache.l3.put

    def slow_put(*args: Any, **kw: Any) -> Any:
        time.sleep(delay)
        return put(*args, **kw)

    monkeypatch.setattr(cache.l3, "put", slow_put)


class LiveBlocks:
    """Bytes of the L1 blocks alive right now (any reference at all: a handle, a queued write),
    whatever the pool's accounting says: wraps the pool's allocation with weakref finalizers."""

    def __init__(self, cache: TieredCache, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        self.peak = 0
        self._lock = threading.Lock()
        alloc = cache.l1._new_layers

        def tracked(capacity: int) -> Any:
            layers = alloc(capacity)
            base = layers[0][0]._base
            assert base is not None  # one block per session on the CPU
            n = base.numel() * base.element_size()
            with self._lock:
                self.bytes += n
                self.peak = max(self.peak, self.bytes)
            weakref.finalize(base, self._freed, n)
            return layers

        monkeypatch.setattr(cache.l1, "_new_layers", tracked)

    def _freed(self, n: int) -> None:
        with self._lock:
            self.bytes -= n


class Budget:
    """Checks kvtier's accounted device bytes against `device_bytes()`, after each commit
    (`check`) and from a sampler thread (`with Budget(...)`)."""

    def __init__(self, cache: TieredCache, live: LiveBlocks | None = None) -> None:
        self.cache = cache
        self.live = live
        parts = cache.device_bytes()
        self.parts = parts
        self.total = parts["l1"] + parts["staging"] + parts["inflight_max"]
        self.errors: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def check(self) -> None:
        c = self.cache
        used, inflight = c.l1.used_bytes, c.inflight_bytes()
        self.samples += 1
        if used > self.parts["l1"]:
            self.errors.append(f"L1 holds {used} of {self.parts['l1']}")
        if inflight > self.parts["inflight_max"]:
            self.errors.append(f"{inflight} bytes in flight, bound {self.parts['inflight_max']}")
        if used + self.parts["staging"] + inflight > self.total:
            self.errors.append(f"{used} + staging + {inflight} > {self.total}")
        if (
            self.live is not None
            and self.live.bytes > self.parts["l1"] + self.parts["inflight_max"]
        ):
            self.errors.append(f"{self.live.bytes} bytes of L1 blocks alive")

    def _run(self) -> None:
        while not self._stop.wait(0.0005):
            self.check()

    def __enter__(self) -> Budget:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def seed(
    cache: TieredCache,
    sessions: int,
    budget: Budget,
    ctx: Callable[[int], list[int]] = context,
) -> dict[int, list[int]]:
    """Every session's context committed from its K/V (fleet_serve's `seed`)."""
    committed = {}
    for sid in range(sessions):
        ids = ctx(sid)
        s = cache.session(f"s{sid}", tenant="t")
        kv = s.restore(torch.tensor([ids], device=cache.device))
        covered = kv.get_seq_length()
        kv.extend(kv_of(cache, sid, len(ids))[..., covered:, :].to(cache.device))
        s.commit(ids)
        committed[sid] = ids
        budget.check()
    return committed


def verify(cache: TieredCache, committed: dict[int, list[int]]) -> None:
    """Every session restores all it committed, bit-equal to the K/V it was given."""
    for sid, ids in committed.items():
        s = cache.session(f"s{sid}", tenant="t")
        kv = s.restore(torch.tensor([[*ids, 7]], device=cache.device))
        assert kv.get_seq_length() == len(ids), f"session {sid} came back short"
        want = kv_of(cache, sid, len(ids)).to(cache.device)
        for layer in range(cache.geometry.num_layers):
            k, v = kv.layers[layer].keys, kv.layers[layer].values
            assert k is not None and v is not None
            assert torch.equal(k, want[layer, 0]), f"session {sid}, layer {layer}: K differs"
            assert torch.equal(v, want[layer, 1]), f"session {sid}, layer {layer}: V differs"
        s.abort()


# -- the fleet: 256 sessions, a tiny L2, a slow L3 -------------------------------------------


def test_256_sessions_into_a_tiny_l2_and_a_slow_l3(tmp_path: Path, monkeypatch) -> None:
    model = tiny_llama()
    per_session = 64 * 512  # L1 capacity of one context (64 tokens) x bytes per token (fp32)
    slot = CHUNK * 512
    cache = TieredCache(cfg(tmp_path, l1_bytes=2 * per_session, l2_bytes=6 * slot), model)
    assert cache.l2.n_slots == 6
    slow_l3(cache, monkeypatch, L3_DELAY_S)
    live = LiveBlocks(cache, monkeypatch)
    with Budget(cache, live) as budget:
        committed = seed(cache, SESSIONS, budget)
        snap = cache.stats()
        cache.close()  # hibernates the sessions still in L1, finishes every L3 write
    assert not budget.errors, budget.errors[:5]
    assert budget.samples > SESSIONS
    assert live.peak <= budget.parts["l1"]  # copies finish at once on the CPU
    assert snap.backpressure_waits > 0, "L2 was never full of writes: the test is too lax"
    assert snap.backpressure_wait_seconds > 0
    assert snap.backpressure_drops == 0  # every wait made room: nothing was recomputed
    assert snap.tier("l1").evictions >= SESSIONS - 2  # type: ignore[union-attr]
    again = TieredCache(cfg(tmp_path, l1_bytes=2 * per_session, l2_bytes=6 * slot), model)
    try:
        verify(again, committed)
    finally:
        again.close()


# -- device copies in flight, stood in for on the CPU ------------------------------------------


class SlowCopy:
    """A device copy that finishes `seconds` after it was issued (a stand-in for a CUDA
    event): until then it holds what it reads, as the allocator holds a block its stream
    still uses."""

    def __init__(self, keep: Any, seconds: float) -> None:
        self._keep = keep
        self._at = time.monotonic() + seconds
        self._timer = threading.Timer(seconds, self._finish)
        self._timer.daemon = True
        self._timer.start()

    def _finish(self) -> None:
        self._keep = None

    def done(self) -> bool:
        return time.monotonic() >= self._at and self._keep is None

    def wait(self, spin: bool = False) -> None:
        self._timer.join()


def slow_device_copies(cache: TieredCache, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    offload = cache.engine.offload

    def slow(layers: Any, *args: Any, **kw: Any) -> Any:
        offload(layers, *args, **kw)  # the bytes land at once; the copy "runs" on
        return SlowCopy(layers, seconds)

    monkeypatch.setattr(cache.engine, "offload", slow)


def test_released_l1_still_going_down_counts_in_flight_under_its_bound(
    tmp_path: Path, monkeypatch
) -> None:
    """Sessions leave L1 (evicted, or grown into a larger block) while their chunks are still
    going down: the old blocks stay alive until those copies finish, and the cache counts them
    in flight, never past `inflight_bytes_max`: the next release waits for them instead."""
    model = tiny_llama()
    per_session = 96 * 512  # a grown context's L1: 96 tokens
    block = 64 * 512  # before it grows
    cache = TieredCache(
        cfg(tmp_path, l1_bytes=3 * per_session, inflight_bytes_max=block + block // 2), model
    )
    slow_device_copies(cache, monkeypatch, 0.05)
    live = LiveBlocks(cache, monkeypatch)
    pending: list[tuple[int, bool]] = []  # (bytes, copy still running) of each retirement
    retire = cache.engine.inflight.retire

    def tracked(handle: Any, nbytes: int) -> None:
        pending.append((nbytes, handle is not None and not handle.done()))
        retire(handle, nbytes)

    monkeypatch.setattr(cache.engine.inflight, "retire", tracked)
    grown: list[bool] = []  # whether the session's last copy down still ran as it grew
    grow = cache.grow_session

    def tracked_grow(s: Any, tokens: int) -> None:
        grown.append(s.bufs.copy is not None and not s.bufs.copy.done())
        grow(s, tokens)

    monkeypatch.setattr(cache, "grow_session", tracked_grow)
    with Budget(cache, live) as budget:
        committed = seed(cache, 48, budget)
        assert [cache.session(f"s{i}", tenant="t").resident for i in range(44, 48)] == [True] * 4
        # the resident ones (their commit's copies still running) grow past their block, then
        # hibernated ones come back grown
        for sid in (47, 46, 45, 44, 40, 41):
            ids = context(sid, extra=2 * CHUNK)
            s = cache.session(f"s{sid}", tenant="t")
            kv = s.restore(torch.tensor([ids]))
            covered = kv.get_seq_length()
            kv.extend(kv_of(cache, sid, len(ids))[..., covered:, :])
            s.commit(ids)
            committed[sid] = ids
            budget.check()
        cache.flush()
    assert not budget.errors, budget.errors[:5]
    assert any(grown)  # a block replaced while its chunks were still going down
    assert sum(running for _, running in pending) > 40  # evictions, mostly while copying
    assert live.peak <= budget.parts["l1"] + budget.parts["inflight_max"]
    assert cache.engine.inflight.peak_bytes <= budget.parts["inflight_max"]
    assert cache.engine.inflight.peak_bytes > 0
    snap = cache.stats()
    assert snap.backpressure_waits > 0 and snap.backpressure_wait_seconds > 0
    assert snap.backpressure_drops == 0
    verify(cache, {sid: committed[sid] for sid in range(0, 48, 5)})
    cache.close()


def test_chunks_from_pages_are_gathered_one_at_a_time(tmp_path: Path, monkeypatch) -> None:
    """A long turn committed from a page pool gathers each chunk as it is stored, within the
    in-flight bound, never all of them at once (each gathered chunk is a new device tensor)."""
    model = tiny_llama()
    pool = _pool(model, pages=256)
    chunk = CHUNK * 512
    cache = TieredCache(cfg(tmp_path, l1_bytes=1 << 20, inflight_bytes_max=chunk), model)
    alive = [0, 0]  # now, most at once
    gather = pool.gather

    def tracked(*args: Any, **kw: Any) -> torch.Tensor:
        out = gather(*args, **kw)
        alive[0] += 1
        alive[1] = max(alive[1], alive[0])
        weakref.finalize(out, lambda: alive.__setitem__(0, alive[0] - 1))
        return out

    monkeypatch.setattr(pool, "gather", tracked)
    ids = context(3, extra=10 * CHUNK)  # 13 full chunks and a tail
    s = cache.session("long", tenant="t")
    kv = s.restore(torch.tensor([ids]), pool=pool)
    with torch.no_grad():
        model(torch.tensor([ids]), **{cache_kwarg(model): kv})
    s.commit(ids)
    assert alive[1] == 1
    assert s.info().chunks_l2 == len(ids) // CHUNK + 1
    cache.close()


# -- the ledger on its own -----------------------------------------------------------------------


def test_inflight_ledger_never_passes_its_bound_across_threads() -> None:
    waits: list[float] = []
    lock = threading.Lock()

    def on_wait(seconds: float) -> None:
        with lock:
            waits.append(seconds)

    ledger = Inflight(100, on_wait=on_wait)
    over: list[int] = []

    def worker(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(40):
            n = int(torch.randint(1, 60, (1,), generator=g))
            ticket = ledger.take(n)
            assert ticket is not None
            if ledger.bytes() > 100:
                over.append(ledger.bytes())
            ledger.bind(ticket, SlowCopy(None, 0.001 * int(torch.randint(0, 4, (1,), generator=g))))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    ledger.drain()
    assert not over
    assert ledger.peak_bytes <= 100
    assert ledger.bytes() == 0
    assert waits  # 6 threads of up to 59 bytes each met the bound of 100


def test_inflight_ledger_retire_and_give_back() -> None:
    ledger = Inflight(10)
    assert ledger.take(11) is None  # larger than the bound alone: nothing taken
    t = ledger.take(6)
    assert t is not None and ledger.bytes() == 6
    ledger.give_back(t)  # the copy was never issued
    assert ledger.bytes() == 0
    slow = SlowCopy(None, 0.05)
    ledger.retire(slow, 8)  # counted until the copy is done
    assert ledger.bytes() == 8
    t0 = time.perf_counter()
    ledger.retire(SlowCopy(None, 0.01), 5)  # 8 + 5 > 10: waits for the first copy
    assert time.perf_counter() - t0 >= 0.03
    assert ledger.bytes() <= 5
    big = SlowCopy(None, 0.02)
    ledger.retire(big, 50)  # larger than the bound: waited for at once, never counted
    assert big.done() and ledger.bytes() <= 5
    ledger.drain()
    assert ledger.bytes() == 0


def test_a_gather_buffer_is_reused_once_its_copy_is_done() -> None:
    """A gather buffer is busy while its ticket's copy runs, and handed out again once the
    ledger gave that room back (its copy done, or the room returned unused): never more
    buffers than chunks under the bound."""
    ledger = Inflight(2 * 64)  # two chunks of 16 float32
    bufs = GatherBuffers(ledger, torch.device("cpu"), torch.float32, 16)
    t1, t2 = ledger.take(64), ledger.take(64)
    assert t1 is not None and t2 is not None
    a, b = bufs.take(t1, (16,)), bufs.take(t2, (4, 4))
    assert bufs.made == bufs.limit == 2 and a.data_ptr() != b.data_ptr()
    ledger.bind(t1, SlowCopy(None, 0.05))
    ledger.bind(t2, SlowCopy(None, 1.0))
    t3 = ledger.take(64)  # at the bound: waits for the first copy, whose buffer comes back
    assert t3 is not None and t1.done and not t2.done
    c = bufs.take(t3, (2, 8))
    assert c.data_ptr() == a.data_ptr() and bufs.made == 2
    ledger.give_back(t3)  # its chunk was never copied: the buffer is free again at once
    t4 = ledger.take(64)
    assert t4 is not None and bufs.take(t4, (16,)).data_ptr() == a.data_ptr()
    with pytest.raises(ValueError, match="larger than a chunk"):
        bufs.take(t4, (17,))
    assert bufs.made == 2


def test_inflight_bound_is_configured_and_reported(tmp_path: Path) -> None:
    model = tiny_llama()
    with pytest.raises(ConfigError, match="inflight_bytes_max"):
        cfg(tmp_path, inflight_bytes_max=0)
    with pytest.raises(ConfigError, match="at least one chunk"):
        TieredCache(cfg(tmp_path, l1_bytes=1 << 20, inflight_bytes_max=100), model)
    cache = TieredCache(cfg(tmp_path / "a", l1_bytes=1 << 20), model)
    parts = cache.device_bytes()
    assert parts["l1"] == 1 << 20
    assert parts["staging"] == cache.engine.staging_bytes == 0  # native codec, CPU
    # the default: as much as the staging buffers a GPU engine would hold (4 of 4 chunks)
    assert parts["inflight_max"] == 4 * 4 * CHUNK * 512
    assert cache.inflight_bytes() == 0
    cache.close()
    cache = TieredCache(cfg(tmp_path / "b", l1_bytes=1 << 20, inflight_bytes_max=3 << 20), model)
    assert cache.device_bytes()["inflight_max"] == 3 << 20
    cache.close()


# -- the same fleet on a GPU: torch's allocator is the judge ---------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_256_sessions_stay_within_the_device_budget(tmp_path: Path, monkeypatch) -> None:
    """On the GPU: `torch.cuda.memory_allocated` never passes the weights plus kvtier's budget
    (L1 + staging + in-flight bound) plus the one session's K/V the loop hands in, though 256
    sessions go through an L1 of two contexts, a tiny L2 and a slow L3."""
    model = tiny_llama().cuda()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # the weights
    chunk = 64
    per_token = 512
    per_session = 4 * chunk * per_token  # 3 full chunks, a tail and the token after it
    slot = chunk * per_token
    cache = TieredCache(
        CacheConfig(
            l3_root=tmp_path,
            l1_bytes=2 * per_session + 4 * 4 * slot,  # two contexts and the staging buffers
            l2_bytes=6 * slot,
            chunk_tokens=chunk,
            cost_model=False,
            pin_memory=True,
        ),
        model,
    )
    slow_l3(cache, monkeypatch, L3_DELAY_S)
    parts = cache.device_bytes()
    kv_in = per_session  # the K/V a seeding turn hands to `extend` (freed after it)
    limit = base + parts["l1"] + parts["staging"] + parts["inflight_max"] + kv_in
    peaks: list[int] = []

    def ctx(sid: int) -> list[int]:
        g = torch.Generator().manual_seed(1000 + sid)
        return [int(x) for x in torch.randint(1, 250, (3 * chunk + 1 + sid % 7,), generator=g)]

    class Allocated(Budget):
        def check(self) -> None:
            super().check()
            peaks.append(torch.cuda.memory_allocated())

    torch.cuda.reset_peak_memory_stats()
    with Allocated(cache) as budget:
        committed = seed(cache, SESSIONS, budget, ctx)
        cache.flush()
    torch.cuda.synchronize()
    assert not budget.errors, budget.errors[:5]
    assert max(peaks) <= limit, f"{max(peaks) - base} device bytes beside the weights"
    assert torch.cuda.max_memory_allocated() <= limit + kv_in  # its copy to the device, too
    snap = cache.stats()
    assert snap.backpressure_waits > 0 and snap.backpressure_drops == 0
    cache.close()
    again = TieredCache(
        CacheConfig(
            l3_root=tmp_path,
            l1_bytes=2 * per_session + 4 * 4 * slot,
            l2_bytes=6 * slot,
            chunk_tokens=chunk,
            cost_model=False,
        ),
        model,
    )
    try:
        verify(again, committed)
    finally:
        again.close()
