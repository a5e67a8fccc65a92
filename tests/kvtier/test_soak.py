"""Soak: 10,000 cycles of session churn through L1 (alloc, grow, release) and L2 (offload,
restore, eviction). Every restore is checked token by token; at the end every L2 slot is free
and L1's reserved memory is back within 5% of its level after warm-up."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from kvtier.codecs import make_codec
from kvtier.errors import L1BudgetExceeded
from kvtier.geometry import KVGeometry
from kvtier.tiers.l1 import L1Pool, SessionBuffers
from kvtier.tiers.l2 import HostArena
from kvtier.transfer import TransferEngine

CHUNK = 16
G = KVGeometry(2, 2, 8, 8, "float32", "gqa")


@dataclass
class Session:
    seed: int
    tokens: int
    bufs: SessionBuffers | None = None
    slots: list[int] = field(default_factory=list)


def _fill(bufs: SessionBuffers, seed: int, first: int, last: int) -> None:
    """Token t of layer l, plane p holds seed*1e4 + l*1e3 + p*500 + t (exact in float32)."""
    t = torch.arange(first, last, dtype=torch.float32, device=bufs.layers[0][0].device)
    for layer, pair in enumerate(bufs.layers):
        for plane, tensor in enumerate(pair):
            value = seed * 1e4 + layer * 1e3 + plane * 500 + t
            tensor[0, :, first:last] = value.view(1, -1, 1)


def _check(bufs: SessionBuffers, s: Session) -> None:
    t = torch.arange(s.tokens, dtype=torch.float32, device=bufs.layers[0][0].device)
    for layer, pair in enumerate(bufs.layers):
        for plane, tensor in enumerate(pair):
            want = (s.seed * 1e4 + layer * 1e3 + plane * 500 + t).view(1, 1, -1, 1)
            assert torch.equal(tensor[:, :, : s.tokens], want.expand_as(tensor[:, :, : s.tokens]))


def soak(device: str, cycles: int = 10_000, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    codec = make_codec("native", G)
    pool = L1Pool(G, G.chunk_bytes(CHUNK) * 40, device, CHUNK)
    arena = HostArena(codec.payload_bytes(CHUNK), codec.payload_bytes(CHUNK) * 48, pin=None)
    eng = TransferEngine(G, CHUNK, device, arena, None, codec)
    sessions: dict[int, Session] = {}
    next_id = 0
    counts = dict.fromkeys(
        ("open", "grow", "hibernate", "resume", "close", "evict_l1", "evict_l2"), 0
    )

    def drop_l2(s: Session) -> None:
        for slot in s.slots:
            eng.forget(slot)
            arena.free(slot)
        s.slots = []

    def hibernate(s: Session, keep: Session | None = None) -> bool:
        assert s.bufs is not None
        need = -(-s.tokens // CHUNK)
        slots: list[int] = []
        while len(slots) < need:
            slot = arena.alloc()
            if slot is None:
                victims = [v for v in sessions.values() if v.slots and v is not s and v is not keep]
                if not victims:
                    for got in slots:
                        arena.free(got)
                    return False
                victim = rng.choice(victims)  # a random eviction from L2
                drop_l2(victim)
                if victim.bufs is None:
                    del sessions[next(k for k, v in sessions.items() if v is victim)]
                counts["evict_l2"] += 1
                continue
            slots.append(slot)
        eng.offload_range(s.bufs.layers, 0, s.tokens, slots).wait()
        s.slots = slots
        pool.release(s.bufs)
        s.bufs = None
        return True

    def l1_alloc(tokens: int, keep: Session | None = None) -> SessionBuffers:
        while True:
            try:
                return pool.allocate(tokens)
            except L1BudgetExceeded:
                victims = [v for v in sessions.values() if v.bufs is not None and v is not keep]
                victim = rng.choice(victims)
                counts["evict_l1"] += 1
                if not hibernate(victim, keep):
                    pool.release(victim.bufs)  # type: ignore[arg-type]
                    victim.bufs = None
                    sessions.pop(next(k for k, v in sessions.items() if v is victim))

    def release_all() -> None:
        for s in list(sessions.values()):
            if s.bufs is not None:
                pool.release(s.bufs)
            drop_l2(s)
        sessions.clear()

    warm_reserved = -1
    for cycle in range(cycles):
        if cycle == cycles // 10:  # warm-up done: measure the empty pool's footprint
            release_all()
            warm_reserved = pool.reserved_bytes()
        op = rng.random()
        live = [s for s in sessions.values() if s.bufs is not None]
        parked = [s for s in sessions.values() if s.bufs is None]
        if op < 0.25 or not sessions:
            tokens = rng.randrange(1, 4 * CHUNK)
            s = Session(seed=next_id % 97, tokens=tokens)
            s.bufs = l1_alloc(tokens)
            _fill(s.bufs, s.seed, 0, tokens)
            sessions[next_id] = s
            next_id += 1
            counts["open"] += 1
        elif op < 0.45 and live:
            s = rng.choice(live)
            new = s.tokens + rng.randrange(1, 2 * CHUNK)
            if pool.round_up(new) * G.bytes_per_token * 2 < pool.budget_bytes // 2:
                try:
                    assert s.bufs is not None
                    pool.grow(s.bufs, new, keep=s.tokens)
                except L1BudgetExceeded:
                    hibernate(s)
                    continue
                _fill(s.bufs, s.seed, s.tokens, new)
                s.tokens = new
                counts["grow"] += 1
        elif op < 0.65 and live:
            if hibernate(rng.choice(live)):
                counts["hibernate"] += 1
        elif op < 0.85 and parked:
            s = rng.choice(parked)
            s.bufs = l1_alloc(s.tokens, keep=s)
            eng.restore_range(s.slots, s.tokens, s.bufs.layers, 0).wait()
            _check(s.bufs, s)
            drop_l2(s)
            counts["resume"] += 1
        elif sessions:
            key = rng.choice(list(sessions))
            s = sessions.pop(key)
            if s.bufs is not None:
                pool.release(s.bufs)
            drop_l2(s)
            counts["close"] += 1
    release_all()
    if device != "cpu":
        torch.cuda.synchronize()
    end_reserved = pool.reserved_bytes()
    result = {
        "free_slots": arena.free_slots,
        "n_slots": arena.n_slots,
        "l1_used": pool.used_bytes,
        "warm_reserved": warm_reserved,
        "end_reserved": end_reserved,
        **counts,
    }
    eng.close()
    arena.close()
    return result


def _assert_clean(r: dict[str, float]) -> None:
    assert r["free_slots"] == r["n_slots"], r
    assert r["l1_used"] == 0, r
    assert r["end_reserved"] <= r["warm_reserved"] * 1.05, r
    for op in ("open", "grow", "hibernate", "resume", "close", "evict_l1", "evict_l2"):
        assert r[op] > 50, f"the soak never exercised {op}: {r}"


@pytest.mark.slow
def test_soak_cpu() -> None:
    _assert_clean(soak("cpu"))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_soak_gpu() -> None:
    _assert_clean(soak("cuda"))
