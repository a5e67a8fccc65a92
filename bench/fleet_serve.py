"""The five ways `bench/fleet_concurrent.py` serves a fleet of agent sessions, in-process.

Every driver takes a `Fleet` (the sessions' initial contexts, what each turn appends, the think
times) and the KV each session's initial context already computed (`bank`, on the host), serves
turns until its time limit and fills a `Measure`. Only what happens inside the measured window
(after `warmup` seconds) is counted.

  ceiling      batched eager DynamicCache, every session's KV on the GPU, all sessions in lockstep
  generate     transformers' `generate_batch` (its own continuous batching), one call per round
  kvtier-seq   kvtier TieredCache, one session per forward (the engine without batching)
  kvtier-batch (fleet_batched.py) kvtier's BatchScheduler over the paged pool, from a TieredCache
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvtier.server.backend import TieredBackend
from kvtier.server.config import ServerConfig
from kvtier.server.pages.pagecopy import append_kv

OOM_NAMES = ("OutOfMemoryError", "L1BudgetExceeded", "PoolExhausted")


@dataclass
class Fleet:
    """The workload: the same for every configuration (same seeds)."""

    contexts: list[list[int]]  # per session: its initial context (all of one length)
    system: int  # leading tokens every context shares (the system prompt)
    decode: int  # tokens decoded per turn
    think: tuple[float, float]  # think time between two turns of a session: uniform(lo, hi)
    max_growth: int  # a conversation longer than initial + this starts over (a new session)
    seed: int = 0

    def append(self, sid: int, turn: int) -> list[int]:
        """What turn `turn` of session `sid` appends to its context (50-200 tokens)."""
        rng = random.Random(f"append-{self.seed}-{sid}-{turn}")
        return [rng.randrange(100, 30000) for _ in range(rng.randint(50, 200))]

    def think_s(self, sid: int, turn: int) -> float:
        """Seconds session `sid` thinks before turn `turn`; before the first, uniform(0, hi):
        the sessions arrive spread out, not in one burst."""
        rng = random.Random(f"think-{self.seed}-{sid}-{turn}")
        return rng.uniform(0.0, self.think[1]) if turn == 1 else rng.uniform(*self.think)


@dataclass
class Measure:
    """What one configuration measured inside its window."""

    name: str
    tokens: int = 0  # tokens decoded inside the window
    window: float = 0.0  # seconds
    ttft: list[float] = field(default_factory=list)  # returning turns, first token in the window
    steps: list[float] = field(default_factory=list)  # forward steps inside the window
    turns: int = 0
    ooms: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    peak_allocated: int = 0
    peak_reserved: int = 0
    mallocs: int = -1  # cudaMalloc calls inside the window (torch: num_device_alloc)
    segments: int = -1  # allocator segments created inside the window (cross-check)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    window_at: tuple[float, float] | None = None  # the window's (open, close), perf_counter

    def fail(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.errors[name] = self.errors.get(name, 0) + 1
        if name in OOM_NAMES or "out of memory" in str(exc).lower():
            self.ooms += 1
        else:
            self.failed += 1


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def alloc_counters(device: str) -> tuple[int, int]:
    """(cudaMalloc calls, segments created) so far in this process (-1 off CUDA)."""
    if not device.startswith("cuda"):
        return -1, -1
    stats = torch.cuda.memory_stats()
    return int(stats.get("num_device_alloc", -1)), int(stats.get("segment.all.allocated", -1))


class Window:
    """The measured window of one configuration: [start + warmup, start + limit)."""

    def __init__(self, device: str, warmup: float, limit: float, segments: bool = False) -> None:
        self.device = device
        self.t0 = time.perf_counter()
        self.open_at = self.t0 + warmup
        self.close_at = self.t0 + limit
        self.opened = False
        self.before = (-1, -1)
        self.after: tuple[int, int] | None = None
        # with `segments` (CUDA): the allocator's segments at the open and the close, so the
        # report can say which memory pool the window's cudaMallocs went to (a snapshot takes
        # milliseconds: only in diagnostic runs)
        self.segments = segments and device.startswith("cuda")
        self.seg_before: dict[int, str] = {}
        self.seg_after: dict[int, str] | None = None

    def inside(self, t: float) -> bool:
        return self.open_at <= t < self.close_at

    def over(self) -> bool:
        return time.perf_counter() >= self.close_at

    def poll(self) -> None:
        """Read the allocator counters when the window opens and when it closes (call often;
        `finish` reads them at the close where no poll did)."""
        now = time.perf_counter()
        if not self.opened and now >= self.open_at:
            self.opened = True
            self.before = alloc_counters(self.device)
            if self.segments:
                self.seg_before = segment_pools()
        if self.opened and self.after is None and now >= self.close_at:
            self.after = alloc_counters(self.device)
            if self.segments:
                self.seg_after = segment_pools()

    def finish(self, m: Measure) -> None:
        m.window = max(self.close_at - self.open_at, 1e-9)
        m.window_at = (self.open_at, self.close_at)
        if self.opened and self.before[0] >= 0:
            after = self.after or alloc_counters(self.device)
            m.mallocs = after[0] - self.before[0]
            m.segments = after[1] - self.before[1]
        if self.segments and self.opened:
            new = self.seg_after if self.seg_after is not None else segment_pools()
            pools: dict[str, int] = {}
            for addr, pool in new.items():
                if addr not in self.seg_before:
                    pools[pool] = pools.get(pool, 0) + 1
            if pools:
                where = ", ".join(f"{n} in {pool}" for pool, n in sorted(pools.items()))
                m.extra["new_segments"] = pools
                m.note = (m.note + "; " if m.note else "") + f"new segments: {where}"


def segment_pools() -> dict[int, str]:
    """The CUDA allocator's segments: address -> its memory pool ("default", or "pool a.b",
    e.g. kvtier's L1 MemPool or a CUDA graph's private pool)."""
    from kvtier.tiers.l1 import _POOLS  # kvtier's L1 MemPool of each device

    named = {tuple(p.id): "kvtier L1" for p in _POOLS.values()}  # type: ignore[attr-defined]
    out = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        name = "default" if pool == (0, 0) else named.get(pool, f"pool {pool[0]}.{pool[1]}")
        out[int(seg["address"])] = name
    return out


# ---- device memory: the cap, the weights, what a configuration holds beyond them ---------------

GIB = 2**30


def cap_gpu_memory(gib: float, device: str) -> str:
    """Cap this process's CUDA allocator at `gib` GiB of the device (0: uncapped), as a smaller
    GPU would hold: `torch.cuda.set_per_process_memory_fraction`, so an allocation past the cap
    raises out-of-memory. Call it before anything is allocated to run as that GPU; it may be
    changed later (a bench running several caps). Returns a line for the header. Off CUDA,
    nothing is capped and the line says so."""
    if not device.startswith("cuda"):
        return f"GPU memory cap of {gib:g} GiB ignored: the device is {device}, not a GPU"
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    if gib <= 0 or gib * GIB >= total:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        over = f" ({gib:g} GiB asked: more than the device)" if gib > 0 else ""
        return f"GPU memory uncapped: all {total / GIB:.1f} GiB of the device{over}"
    fraction = gib * GIB / total
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    return (
        f"GPU memory capped at {gib:g} GiB ({fraction:.3f} of the device's {total / GIB:.1f} "
        "GiB; torch's allocator refuses more)"
    )


def weight_bytes(model) -> int:
    """The model's resident bytes: its parameters and buffers (the rotary tables)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


class MemorySampler:
    """`torch.cuda.memory_allocated()` every `period` seconds from a thread, with the time:
    the median inside a configuration's window is its steady device memory. Off CUDA it takes
    no samples."""

    def __init__(self, device: str, period: float = 0.2) -> None:
        self.cuda = device.startswith("cuda")
        self.period = period
        # the device's index, resolved here: the thread then reads the allocator's host-side
        # counters alone, no CUDA call (it runs while the scheduler captures its CUDA graphs)
        index = torch.device(device).index if self.cuda else None
        self.index = torch.cuda.current_device() if self.cuda and index is None else index
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> MemorySampler:
        if self.cuda:
            self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            self.samples.append((time.perf_counter(), int(torch.cuda.memory_allocated(self.index))))
            if self._stop.wait(self.period):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def median(self, window: tuple[float, float] | None) -> int | None:
        """The median sample inside `window` (all of them without one, or none inside); None
        without samples."""
        inside = [b for t, b in self.samples if window is None or window[0] <= t < window[1]]
        chosen = inside or [b for _, b in self.samples]
        return int(statistics.median(chosen)) if chosen else None


def device_memory(m: Measure, sampler: MemorySampler, weights: int, budget: int | None) -> None:
    """Put into `m.extra` the device bytes the configuration held beyond the weights: steady
    (the median sample inside its window) and peak (`max_memory_allocated` since the peak was
    reset at its start), and its budget; None off CUDA (the report prints n/a)."""
    steady = sampler.median(m.window_at) if sampler.cuda else None
    peak = int(torch.cuda.max_memory_allocated()) if sampler.cuda else None
    m.extra["device_steady_bytes"] = None if steady is None else steady - weights
    m.extra["device_peak_bytes"] = None if peak is None else peak - weights
    m.extra["device_budget_bytes"] = budget


def count_sources(sources: list[str]) -> dict[str, int]:
    """Restore sources of returning turns, every tier named (l1, l2, l3, recompute, l4 seen)."""
    seen = Counter(sources)
    out = {k: seen.pop(k, 0) for k in ("l1", "l2", "l3", "recompute")}
    return {**out, **dict(seen)}


def bank_layers(bank: list[tuple[torch.Tensor, torch.Tensor]], sid: int, start: int, device: str):
    """Session `sid`'s initial K/V from token `start` on, per layer `[1, kv_heads, n, dim]`."""
    return [
        (k[sid : sid + 1, :, start:].to(device), v[sid : sid + 1, :, start:].to(device))
        for k, v in bank
    ]


# ---- (a) the ceiling -------------------------------------------------------------------------


def run_ceiling(
    model,
    fleet: Fleet,
    bank,
    device: str,
    warmup: float,
    limit: float,
    cache: Any = None,
    name: str = "ceiling",
) -> Measure:
    """All sessions in one batched DynamicCache (all KV resident), in lockstep: every round
    appends the same number of tokens to every session (no padding), then decodes `decode`
    tokens in one forward per step. Think time is skipped: this is the upper bound. `cache`:
    a DynamicCache already holding the sessions' initial contexts (then `bank` is not read;
    the caller keeps it, bench/small_gpu.py grows it further)."""
    m = Measure(name)
    n = len(fleet.contexts)
    initial = len(fleet.contexts[0])
    with torch.no_grad():
        if cache is None:
            cache = DynamicCache(config=model.config)
            for i, (k, v) in enumerate(bank):
                cache.update(k.to(device), v.to(device), i)
        sync(device)
        win = Window(device, warmup, limit)
        turn = 1
        while not win.over():
            win.poll()
            if cache.get_seq_length() + 200 + fleet.decode > initial + fleet.max_growth:
                # every conversation starts over from its initial context (crop takes a negative
                # count, the tokens to drop, in every transformers version)
                cache.crop(initial - cache.get_seq_length())
            ids = _round_ids(fleet, n, turn, device)
            sync(device)
            t0 = time.perf_counter()
            tok = model(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
            sync(device)
            t1 = time.perf_counter()
            counted = win.inside(t0)
            if counted:
                m.ttft.extend([t1 - t0] * n)
                m.turns += n
            if win.inside(t1):
                m.tokens += n
            for _ in range(fleet.decode - 1):
                s0 = time.perf_counter()
                tok = model(tok, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
                sync(device)
                s1 = time.perf_counter()
                if win.inside(s1):
                    m.steps.append(s1 - s0)
                    m.tokens += n
            turn += 1
        win.finish(m)
    m.extra["batch"] = n
    del cache
    return m


def _round_ids(fleet: Fleet, n: int, turn: int, device: str) -> torch.Tensor:
    """The tokens every session appends in lockstep round `turn`: its own append, all cut to
    the round's common length (that of session 0)."""
    k = len(fleet.append(0, turn))
    rows = []
    for s in range(n):
        a = fleet.append(s, turn)
        rows.append((a * (k // len(a) + 1))[:k])
    return torch.tensor(rows, device=device)


# ---- (b) transformers generate_batch ----------------------------------------------------------


def has_generate_batch(model) -> bool:
    return callable(getattr(model, "generate_batch", None))


def run_generate(model, fleet: Fleet, device: str, limit: float) -> Measure:
    """Rounds of `model.generate_batch` over every session's whole context (transformers keeps
    no KV between calls, so each round prefills every context again). The first round is the
    warm-up; later rounds are counted while the time limit allows. TTFT and steps come from the
    per-token timestamps where this transformers records them."""
    from transformers import GenerationConfig

    m = Measure("generate_batch")
    n = len(fleet.contexts)
    ctx = [list(c) for c in fleet.contexts]
    params = inspect.signature(model.generate_batch).parameters
    kwargs: dict[str, Any] = {}
    if "record_timestamps" in params:
        kwargs["record_timestamps"] = True
    if "progress_bar" in params:
        kwargs["progress_bar"] = False
    gen_cfg = GenerationConfig(
        max_new_tokens=fleet.decode, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    t_start = time.perf_counter()
    rounds = 0
    counted_rounds = 0
    before = alloc_counters(device)
    while True:
        prompts = [c + fleet.append(s, rounds + 1) for s, c in enumerate(ctx)]
        if rounds == 1:
            before = alloc_counters(device)
        sync(device)
        r0 = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gen_cfg, **kwargs)
        sync(device)
        r1 = time.perf_counter()
        rounds += 1
        outs = list(out.values())
        errors = [o for o in outs if getattr(o, "error", None)]
        for o in errors:
            m.fail(RuntimeError(str(o.error)))
        warm = rounds == 1
        elapsed = r1 - t_start
        last = elapsed + (r1 - r0) > limit
        if not warm or last:  # a lone round is counted (noted) rather than nothing
            counted_rounds += 1
            m.window += r1 - r0
            m.turns += len(outs) - len(errors)
            m.tokens += sum(len(o.generated_tokens) for o in outs)
            for o in outs:
                ts = getattr(o, "timestamps", None)
                if ts:
                    m.ttft.append(ts[0] - o.created_time)
                    m.steps.extend(b - a for a, b in itertools.pairwise(ts))
            if warm:
                m.note = "one round only: it includes generate_batch's warm-up"
        by_id = {o.request_id: o for o in outs}
        for s, rid in enumerate(sorted(by_id, key=_request_order)):
            if s < n:
                ctx[s] = prompts[s] + list(by_id[rid].generated_tokens)
                if len(ctx[s]) > len(fleet.contexts[s]) + fleet.max_growth:
                    ctx[s] = list(fleet.contexts[s])
        if last:
            break
    after = alloc_counters(device)
    if before[0] >= 0 and counted_rounds:
        m.mallocs, m.segments = after[0] - before[0], after[1] - before[1]
    if not m.ttft:
        m.note = (m.note + "; " if m.note else "") + "no per-token timestamps: TTFT/steps n/a"
    m.extra["rounds"] = rounds
    return m


def _request_order(rid: str) -> tuple[int, str]:
    """generate_batch names requests req_0, req_1, ...: in input order."""
    digits = "".join(ch for ch in rid if ch.isdigit())
    return (int(digits) if digits else 0, rid)


# ---- kvtier: the cache, seeding, names ---------------------------------------------------------


def tiered_backend(
    model, root: Path, codec: str, l1_bytes: int, l2_bytes: int, policy: str = "write_through"
) -> TieredBackend:
    # the server's own settings, defaults and all (no cap on L3, no L4, no encryption)
    cfg = ServerConfig(
        l3_root=root, l1_bytes=l1_bytes, l2_bytes=l2_bytes, codec=codec, write_policy=policy
    )
    return TieredBackend(model, cfg, model_id=f"bench-{model.config._name_or_path}")


def session_name(sid: int, conv: int) -> str:
    return f"agent-{sid}" if conv == 0 else f"agent-{sid}.{conv}"


TENANT = "fleet"


def seed(cache, fleet: Fleet, bank, device: str) -> float:
    """Every session's initial context committed into the tiered cache from the bank (its K/V,
    computed once), as if each had run its first turn. Sessions past the L1 budget push the
    oldest down to L2/L3. Returns the seconds it took (a configuration's time outside its
    window)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for sid, ctx in enumerate(fleet.contexts):
            s = cache.session(session_name(sid, 0), tenant=TENANT)
            kv = s.restore(torch.tensor([ctx], device=device))
            covered = int(kv.get_seq_length())
            append_kv(kv, bank_layers(bank, sid, covered, device))
            s.commit(ctx)
    return time.perf_counter() - t0


# ---- (c) kvtier, one session per forward -----------------------------------------------------


def run_sequential(
    model, fleet: Fleet, bank, device: str, warmup: float, limit: float, backend
) -> Measure:
    """Today's engine: one process, one model, each ready session's whole turn at a time
    (restore, prefill of the new tokens, decode, commit), first come first served. TTFT counts
    from the end of the session's think time, its wait in the queue included."""
    from kvtier.server.devices.model import cache_kwarg

    m = Measure("kvtier-seq")
    kw = cache_kwarg(model)
    cache = backend.cache
    m.extra["seed_s"] = round(seed(cache, fleet, bank, device), 1)
    n = len(fleet.contexts)
    ctx = [list(c) for c in fleet.contexts]
    conv = [0] * n
    turn = [1] * n
    win = Window(device, warmup, limit)
    ready = [(win.t0 + fleet.think_s(s, 1), s) for s in range(n)]
    heapq.heapify(ready)
    sources: list[str] = []  # returning turns inside the window: where their prefix came from
    with torch.no_grad():
        while not win.over():
            win.poll()
            at, sid = heapq.heappop(ready)
            now = time.perf_counter()
            if at > now:
                time.sleep(min(at - now, max(win.close_at - now, 0.0)))
                if win.over():
                    break
            returning = True
            if len(ctx[sid]) > len(fleet.contexts[sid]) + fleet.max_growth:
                conv[sid] += 1  # the conversation starts over, as a new session
                ctx[sid] = list(fleet.contexts[sid])
                returning = False
            prompt = ctx[sid] + fleet.append(sid, turn[sid])
            turn[sid] += 1
            s = cache.session(session_name(sid, conv[sid]), tenant=TENANT)
            ids = torch.tensor([prompt], device=device)
            try:
                kv = s.restore(ids)
                source = str(s.restore_source)
                past = int(kv.get_seq_length())
                logits = model(ids[:, past:], logits_to_keep=1, **{kw: kv}).logits
                tok = logits[:, -1:].argmax(-1)
                sync(device)
                t1 = time.perf_counter()
                out = [tok]
                for _ in range(fleet.decode - 1):
                    s0 = time.perf_counter()
                    tok = model(tok, logits_to_keep=1, **{kw: kv}).logits[:, -1:].argmax(-1)
                    sync(device)
                    s1 = time.perf_counter()
                    out.append(tok)
                    if win.inside(s1):
                        m.steps.append(s1 - s0)
                        m.tokens += 1
                reply = torch.cat(out, dim=1)[0].tolist()
                s.commit(prompt + reply[:-1])  # the last token's K/V is not computed yet
            except Exception as exc:  # counted; the session forgets the half-done turn
                m.fail(exc)
                s.abort()
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
                heapq.heappush(ready, (time.perf_counter() + fleet.think_s(sid, turn[sid]), sid))
                continue
            if win.inside(t1):
                m.tokens += 1
            if win.inside(t1) and returning:
                m.ttft.append(t1 - at)
                m.turns += 1
                sources.append(source)
            ctx[sid] = prompt + reply
            heapq.heappush(ready, (time.perf_counter() + fleet.think_s(sid, turn[sid]), sid))
    win.finish(m)
    m.extra["returning_sources"] = count_sources(sources)
    return m
