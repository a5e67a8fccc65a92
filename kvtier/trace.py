"""A request trace in Mooncake's format, read and shaped for a replay or a simulation.

One JSON object a line: `timestamp` (arrival, ms from the trace's start), `input_length` and
`output_length` (tokens), `hash_ids` (the prompt's blocks of `BLOCK_TOKENS` tokens; equal ids are
equal blocks, and an id stands for its whole prefix: the trace hashes each block together with
the blocks before it). The last block may be partial.

Pure: text in, plain data out (no I/O but reading the file, no server, no torch).

- Sessions: a request continues the conversation whose request last held the deepest block it
  shares with an earlier request, if that block lies past the first one. (A first block shared
  by all is a system prompt, which prefix sharing serves; it says nothing of a conversation.)
- Sampling keeps whole conversations: a conversation is in the sample when a hash of its first
  request's line number and the seed falls under the fraction, the same on every run.
- Tokens: block id b becomes BLOCK_TOKENS token ids drawn from a hash of (b, seed), so equal
  blocks give equal prompts on any server with the same vocabulary.
- The ideal hit ratio: the prompt tokens of blocks an earlier request of the same slice held,
  over all prompt tokens (an unbounded prefix cache, all sessions sharing it).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import KvtierError

BLOCK_TOKENS = 512
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(KvtierError, ValueError):
    """A trace line that cannot be read: names the file and line and what is wrong."""


@dataclass(frozen=True)
class Request:
    line: int  # 1-based line of the file
    at: float  # seconds from the trace's start
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    session: int = -1  # the line of the conversation's first request


def _int(obj: dict[str, object], key: str, where: str) -> int:
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 0:
        raise TraceError(f"{where}: {key} must be a non-negative integer, got {v!r}")
    return int(v)


def parse_line(text: str, where: str) -> Request | None:
    """One line as a Request (line 0; None for a blank line); TraceError naming `where`."""
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a JSON object is expected, got {type(obj).__name__}")
    missing = [k for k in FIELDS if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)} (a line needs {FIELDS})")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a non-negative number of ms, got {ts!r}")
    n_in, n_out = _int(obj, "input_length", where), _int(obj, "output_length", where)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
    if n_in < 1 or -(-n_in // BLOCK_TOKENS) != len(ids):
        raise TraceError(
            f"{where}: input_length {n_in} needs {-(-n_in // BLOCK_TOKENS)} blocks of "
            f"{BLOCK_TOKENS} tokens, but hash_ids has {len(ids)}"
        )
    return Request(0, float(ts) / 1000, n_in, n_out, tuple(ids))


def parse(lines: Iterable[str], name: str = "trace") -> list[Request]:
    """Every request of `lines`, with its conversation; TraceError on the first bad line or on
    timestamps that go back."""
    out: list[Request] = []
    for n, text in enumerate(lines, start=1):
        req = parse_line(text, f"{name} line {n}")
        if req is None:
            continue
        if out and req.at < out[-1].at:
            raise TraceError(
                f"{name} line {n}: timestamp {req.at * 1000:g} ms is before the previous "
                f"line's {out[-1].at * 1000:g} ms; a trace is in arrival order"
            )
        out.append(Request(n, req.at, req.input_tokens, req.output_tokens, req.blocks))
    if not out:
        raise TraceError(f"{name}: holds no request")
    return assign_sessions(out)


def load(path: str | Path) -> list[Request]:
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as f:
            return parse(f, str(p))
    except UnicodeDecodeError as exc:
        raise TraceError(f"{p}: not UTF-8 text ({exc.reason})") from None


def assign_sessions(requests: Sequence[Request]) -> list[Request]:
    """Each request with its conversation (see the module's docstring)."""
    owner: dict[int, int] = {}  # block id -> session of the request that last held it
    out = []
    for r in requests:
        session = r.line
        for depth, block in enumerate(r.blocks):
            found = owner.get(block)
            if found is None:
                break
            if depth >= 1:
                session = found
        for block in r.blocks:
            owner[block] = session
        out.append(Request(r.line, r.at, r.input_tokens, r.output_tokens, r.blocks, session))
    return out


def _unit(*parts: object) -> float:
    """A number in [0, 1) from a hash of `parts`: the same on every run and machine."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


@dataclass(frozen=True)
class Slice:
    """What to replay of a trace: a fraction of its conversations, its first seconds, its
    prompts cut to a length, its time scaled."""

    sample: float = 1.0  # fraction of conversations, whole
    seed: int = 0
    duration: float | None = None  # seconds of replay (after --speed); None: all
    speed: float = 1.0  # >1: faster than the trace
    max_input: int | None = None  # prompt tokens at most (the first ones kept)
    max_output: int | None = None  # reply tokens at most

    def __post_init__(self) -> None:
        if not 0 < self.sample <= 1:
            raise ValueError(f"sample must be a fraction in (0, 1], got {self.sample}")
        if not self.speed > 0:
            raise ValueError(f"speed must be positive, got {self.speed}")
        for name in ("max_input", "max_output"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be at least 1, got {v}")


@dataclass(frozen=True)
class Turn:
    """One request as it is replayed."""

    request: Request
    at: float  # seconds from the replay's start
    input_tokens: int  # after the cut
    output_tokens: int
    cut: int  # prompt tokens the cut left out
    ideal_cached: int  # tokens an unbounded prefix cache holds for it


def select(requests: Sequence[Request], s: Slice) -> list[Turn]:
    """The turns of `requests` that slice `s` keeps, with their ideal cached tokens."""
    keep = {r.session for r in requests if s.sample >= 1 or _unit(s.seed, r.session) < s.sample}
    t0 = requests[0].at if requests else 0.0
    seen: set[int] = set()
    turns = []
    for r in requests:
        if r.session not in keep:
            continue
        at = (r.at - t0) / s.speed
        if s.duration is not None and at >= s.duration:
            break
        n_in = min(r.input_tokens, s.max_input or r.input_tokens)
        n_out = min(r.output_tokens, s.max_output or r.output_tokens)
        blocks = r.blocks[: -(-n_in // BLOCK_TOKENS)]
        turns.append(
            Turn(r, at, n_in, max(1, n_out), r.input_tokens - n_in, ideal(blocks, n_in, seen))
        )
        seen.update(blocks)
    return turns


def ideal(blocks: Sequence[int], n_tokens: int, seen: set[int]) -> int:
    """Prompt tokens of the leading `blocks` found in `seen` (the prefix an unbounded cache
    holds), the last block counting only its tokens."""
    hit = 0
    for i, block in enumerate(blocks):
        if block not in seen:
            break
        hit += min(BLOCK_TOKENS, n_tokens - i * BLOCK_TOKENS)
    return hit


def ideal_ratio(turns: Sequence[Turn]) -> float:
    total = sum(t.input_tokens for t in turns)
    return sum(t.ideal_cached for t in turns) / total if total else 0.0


def block_tokens(block: int, vocab: int, seed: int = 0) -> tuple[int, ...]:
    """The BLOCK_TOKENS token ids of block `block`, each in [0, vocab)."""
    raw = hashlib.shake_128(f"kvtier-trace:{seed}:{block}".encode()).digest(4 * BLOCK_TOKENS)
    return tuple(v % vocab for v in struct.unpack(f"<{BLOCK_TOKENS}I", raw))


class Tokens:
    """Prompts as token ids; the most recent `keep` blocks' ids are kept, not made again."""

    def __init__(self, vocab: int, seed: int = 0, keep: int = 2048) -> None:
        if vocab < 2:
            raise ValueError(f"vocab must be at least 2 token ids, got {vocab}")
        self.vocab, self.seed, self.keep = vocab, seed, keep
        self._blocks: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def block(self, block: int) -> tuple[int, ...]:
        got = self._blocks.get(block)
        if got is None:
            got = self._blocks[block] = block_tokens(block, self.vocab, self.seed)
            if len(self._blocks) > self.keep:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(block)
        return got

    def prompt(self, blocks: Sequence[int], n_tokens: int) -> list[int]:
        ids: list[int] = []
        for block in blocks:
            ids.extend(self.block(block))
        return ids[:n_tokens]
