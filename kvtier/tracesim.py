"""The cache's tiers simulated over a trace: what each tier serves, reads and writes, by size.

A model of `kvtier serve` with paged L1, chunk by chunk, fast enough to sweep sizes over a whole
trace in seconds (`kvtier plan --trace`):

- A turn's prompt is cut into chunks of `chunk_tokens`. A chunk that lies in the prompt is named
  by the trace's block holding its last token and its end in that block (block ids stand for
  their whole prefix), so equal prefixes give equal chunks across sessions, as the cache's keys
  do inside a tenant. Chunks that hold reply tokens are the turn's own.
- Restore: the longest leading run of chunks that some tier holds, each from the nearest tier
  (L1: the page pool's pages parked by the same conversation, which are its own; L2: host
  memory, shared by all; L3: the SSD, likewise), less the prompt's last
  token, which is always computed. The cost model (`kvtier.cache.costmodel`) then loads the
  leading chunks that are cheaper to load than to recompute, at the given bandwidths and
  prefill speed; the rest is recomputed.
- Commit: the turn's full chunks (prompt and reply) park in the pool (L1), go to L2, and are
  written through to L3. A chunk read from L3 lands in L2. Each tier evicts least recently
  used first; L2 and L3 evictions write nothing (L3 already holds every chunk). L3 evicts no
  chunk that a conversation's latest turn holds (its session record references it, as the
  store's size cap keeps it); when only such chunks are left, a new chunk is not written.
- Hosts: a conversation stays on one host (a hash of it); each host has its own tiers of the
  given sizes, so blocks shared across conversations are found only on the host that has them.

Pure: no torch, no I/O. It leaves out what it cannot know from a trace: timing (a chunk still
being written is taken as written), the batch's running turns in the pool, and sessions
ending (every conversation of the trace is taken to stay).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvtier.cache.costmodel import CostModel
from kvtier.trace import BLOCK_TOKENS, Turn

TIERS = ("l1", "l2", "l3")
# bytes/s to load from each tier, as the cache assumes before it measures (CacheConfig)
DEFAULT_BANDWIDTH = {"l1": 200e9, "l2": 10e9, "l3": 1e9}


@dataclass(frozen=True)
class Sizes:
    """One host's tiers in bytes. l3 None: no cap; 0: no L3. l2 0: no L2."""

    l1: int
    l2: int
    l3: int | None


@dataclass(frozen=True)
class Costs:
    """What the cost model weighs: load bandwidth by tier and the prefill's time per token.
    `cost_model` False loads every cached chunk (the cache's `cost_model = False`)."""

    bandwidth: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BANDWIDTH))
    prefill_s_per_token: float = 30e-6
    cost_model: bool = True


@dataclass
class TierStats:
    hit_tokens: int = 0  # prompt tokens restored from this tier
    read_bytes: int = 0
    written_bytes: int = 0
    evicted_bytes: int = 0


@dataclass
class Result:
    sizes: Sizes
    hosts: int
    prompt_tokens: int = 0
    ideal_tokens: int = 0  # what an unbounded cache of one host holds (the trace's own ideal)
    found_tokens: int = 0  # held by some tier at the restore, before the cost model's choice
    recomputed_tokens: int = 0
    tiers: dict[str, TierStats] = field(default_factory=lambda: {t: TierStats() for t in TIERS})

    @property
    def hit_tokens(self) -> int:
        return sum(t.hit_tokens for t in self.tiers.values())

    def ratio(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "l1_bytes": self.sizes.l1,
            "l2_bytes": self.sizes.l2,
            "l3_bytes": self.sizes.l3,
            "hosts": self.hosts,
            "prompt_tokens": self.prompt_tokens,
            "hit_ratio": self.ratio(self.hit_tokens),
            "ideal_hit_ratio": self.ratio(self.ideal_tokens),
            "found_ratio": self.ratio(self.found_tokens),
            "tiers": {
                t: {
                    "hit_ratio": self.ratio(s.hit_tokens),
                    "read_bytes": s.read_bytes,
                    "written_bytes": s.written_bytes,
                    "evicted_bytes": s.evicted_bytes,
                }
                for t, s in self.tiers.items()
            },
        }


class _Tier:
    """An LRU set of chunks within a byte budget (every chunk has the same size)."""

    def __init__(self, name: str, capacity: int | None, chunk_bytes: int, stats: TierStats):
        self.name = name
        self.slots = None if capacity is None else capacity // chunk_bytes
        self.chunk_bytes = chunk_bytes
        self.stats = stats
        self.keys: OrderedDict[Hashable, None] = OrderedDict()  # evictable, LRU first
        self.held: set[Hashable] = set()  # referenced by a session: never evicted
        self.refs: dict[Hashable, int] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self.keys or key in self.held

    def touch(self, key: Hashable) -> None:
        if key in self.keys:
            self.keys.move_to_end(key)

    def put(self, key: Hashable) -> None:
        """Insert (a write) or touch `key`, evicting the least recently used past the budget;
        nothing is written when every chunk held is referenced."""
        if key in self:
            self.touch(key)
            return
        if self.slots is not None and len(self.keys) + len(self.held) >= self.slots:
            if not self.keys:
                return  # full of referenced chunks: the write is shed
            self.keys.popitem(last=False)
            self.stats.evicted_bytes += self.chunk_bytes
        if self.slots == 0:
            return
        if self.refs.get(key):
            self.held.add(key)
        else:
            self.keys[key] = None
        self.stats.written_bytes += self.chunk_bytes

    def reference(self, new: Sequence[Hashable], old: Sequence[Hashable]) -> None:
        """A session now references `new` and no longer `old` (its previous turn's chunks)."""
        for key in new:
            n = self.refs.get(key, 0)
            self.refs[key] = n + 1
            if n == 0 and self.keys.pop(key, 0) is None:
                self.held.add(key)
        for key in old:
            n = self.refs[key] - 1
            if n:
                self.refs[key] = n
                continue
            del self.refs[key]
            if key in self.held:
                self.held.discard(key)
                self.keys[key] = None


class _Host:
    def __init__(self, sizes: Sizes, chunk_bytes: int, result: Result, costs: Costs) -> None:
        st = result.tiers
        self.tiers = [
            _Tier("l1", sizes.l1, chunk_bytes, st["l1"]),
            _Tier("l2", sizes.l2, chunk_bytes, st["l2"]),
            _Tier("l3", sizes.l3, chunk_bytes, st["l3"]),
        ]
        self.costs = CostModel(dict(costs.bandwidth), costs.prefill_s_per_token)
        self.seen: set[int] = set()  # blocks this host has had: its own ideal
        self.history: dict[int, list[Hashable]] = {}  # each session's latest turn's chunks

    def where(self, session: int, key: Hashable) -> _Tier | None:
        l1, l2, l3 = self.tiers
        if (session, key) in l1:  # parked pages are their conversation's
            return l1
        return l2 if key in l2 else (l3 if key in l3 else None)


def chunk_keys(turn: Turn, chunk_tokens: int) -> tuple[list[Hashable], int]:
    """The keys of the turn's full chunks (prompt and reply) and how many lie in the prompt."""
    n_in, n_out = turn.input_tokens, turn.output_tokens
    blocks = turn.request.blocks
    in_prompt = n_in // chunk_tokens
    keys: list[Hashable] = []
    for i in range(in_prompt):
        last = (i + 1) * chunk_tokens - 1
        keys.append((blocks[last // BLOCK_TOKENS], last % BLOCK_TOKENS))
    for i in range(in_prompt, (n_in + n_out) // chunk_tokens):
        keys.append(("reply", turn.request.line, i))  # holds reply tokens: this turn's alone
    return keys, in_prompt


def _host_of(session: int, hosts: int) -> int:
    if hosts == 1:
        return 0
    digest = hashlib.blake2b(str(session).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % hosts


def simulate(
    turns: Sequence[Turn],
    sizes: Sizes,
    bytes_per_token: int,
    chunk_tokens: int = 256,
    hosts: int = 1,
    costs: Costs | None = None,
) -> Result:
    """Run `turns` through `hosts` hosts of `sizes` each (see the module's docstring)."""
    if chunk_tokens < 1 or bytes_per_token < 1 or hosts < 1:
        raise ValueError("chunk_tokens, bytes_per_token and hosts must be at least 1")
    costs = costs or Costs()
    chunk_bytes = chunk_tokens * bytes_per_token
    result = Result(sizes, hosts)
    fleet = [_Host(sizes, chunk_bytes, result, costs) for _ in range(hosts)]
    for turn in turns:
        host = fleet[_host_of(turn.request.session, hosts)]
        keys, in_prompt = chunk_keys(turn, chunk_tokens)
        n_in = turn.input_tokens
        result.prompt_tokens += n_in
        blocks = turn.request.blocks[: -(-n_in // BLOCK_TOKENS)]
        for i, block in enumerate(blocks):  # the ideal on this host
            if block not in host.seen:
                break
            result.ideal_tokens += min(BLOCK_TOKENS, n_in - i * BLOCK_TOKENS)
        host.seen.update(blocks)
        usable = (n_in - 1) // chunk_tokens  # the last prompt token is always computed
        found: list[_Tier] = []
        session = turn.request.session
        for key in keys[: min(in_prompt, usable)]:
            tier = host.where(session, key)
            if tier is None:
                break
            found.append(tier)
        result.found_tokens += len(found) * chunk_tokens
        if costs.cost_model and found:
            segments = [(t.name, chunk_bytes, chunk_tokens) for t in found]
            take = host.costs.plan(segments)
        else:
            take = len(found)
        for key, tier in zip(keys, found[:take], strict=False):
            tier.stats.hit_tokens += chunk_tokens
            tier.stats.read_bytes += chunk_bytes
            tier.touch((session, key) if tier.name == "l1" else key)
        result.recomputed_tokens += n_in - take * chunk_tokens
        l1, l2, l3 = host.tiers
        for key in keys:  # commit: park in the pool, into L2, through to L3
            l1.put((session, key))
            l2.put(key)
            l3.put(key)
        l3.reference(keys, host.history.get(session, []))
        host.history[session] = keys
    return result


def sweep(
    turns: Sequence[Turn],
    grid: Sequence[Sizes],
    bytes_per_token: int,
    chunk_tokens: int = 256,
    hosts: int = 1,
    costs: Costs | None = None,
) -> list[Result]:
    return [simulate(turns, s, bytes_per_token, chunk_tokens, hosts, costs) for s in grid]


def smallest(results: Sequence[Result], target: float, tier: str) -> Result | None:
    """The result with the smallest `tier` size ("l2" or "l3") whose hit ratio reaches `target`
    (a fraction of the prompt tokens); None when none does."""
    ok = [r for r in results if r.ratio(r.hit_tokens) >= target]
    if not ok:
        return None
    return min(ok, key=lambda r: (getattr(r.sizes, tier) or 0) if tier == "l2" else _l3(r))


def _l3(r: Result) -> float:
    return float("inf") if r.sizes.l3 is None else float(r.sizes.l3)
