"""Structured output: the grammar a request's reply must follow, compiled with xgrammar.

`spec_of` reads what a request asks for (pure: no xgrammar): `response_format` `json_object` or
`json_schema`, or a tool call that `tool_choice` makes required (`required`, or a named
function) in the hermes format of `kvtier.server.decoding.tools`. `GrammarBook` compiles it for one
served model's tokenizer (compiled grammars are cached by their spec), and every constrained
turn gets a `GrammarMatcher` of its own. Each step the batch fills one token bitmask row per
constrained sequence and applies them to the step's logits in one call, on the logits'
device; unconstrained rows are not touched (`kvtier.server.decoding.logitproc`).

The JSON the grammar allows has fixed separators (`", "`, `": "`), no free whitespace: the
reply is exactly what `json.dumps` writes, so a tool call's arguments round-trip as text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.errors import InvalidRequest
from kvtier.server.decoding.grammarlimits import GrammarLimits, check_schema
from kvtier.server.decoding.tools import CALL_CLOSE, CALL_OPEN

# Parallel calls a `tool_choice: required` reply may make (with parallel_tool_calls).
MAX_PARALLEL_CALLS = 4


@dataclass(frozen=True)
class GrammarSpec:
    """What a reply must be: "json" (any JSON object), "schema" (`schema`: JSON text) or
    "tools" (`schema`: the JSON text of the callable tools; `many`: one call or several)."""

    kind: str
    schema: str = ""
    many: bool = False


def spec_of(
    response_format: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
) -> GrammarSpec | None:
    """The grammar a request asks for, or None. Raises InvalidRequest for a bad one."""
    forced = _forced_tools(tools, tool_choice)
    if forced is not None:
        if response_format and response_format.get("type") not in (None, "text"):
            raise InvalidRequest(
                "response_format cannot be combined with a required tool call (tool_choice); "
                "send one of them"
            )
        return GrammarSpec("tools", json.dumps(forced), parallel_tool_calls and len(forced) > 0)
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec("json")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest(
                "response_format json_schema needs `json_schema.schema`, a JSON Schema object"
            )
        # the schema's own key order: the reply's properties follow it (as OpenAI's and vLLM's
        # do: agents put "reasoning" before "answer"); the text is the cache's key too
        return GrammarSpec("schema", json.dumps(schema))
    raise InvalidRequest(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema"
    )


def _forced_tools(tools: list[dict[str, Any]] | None, choice: Any) -> list[dict[str, Any]] | None:
    """The functions a reply must call from (name + parameters), or None when it need not."""
    if choice is None or choice in ("auto", "none"):
        return None
    functions = [t["function"] for t in tools or []]
    if choice == "required":
        if not functions:
            raise InvalidRequest("tool_choice 'required' needs `tools`")
        return functions
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    named = [f for f in functions if f.get("name") == name]
    if not named:
        raise InvalidRequest(f"tool_choice names function {name!r}, which is not in `tools`")
    return named


class GrammarBook:
    """Compiles the grammars of one served model, off the event loop and off the default thread
    pool (which tokenizes prompts and renders /metrics): on `limits.threads` threads of its
    own, one compile per spec at a time however many requests ask for it, and never under the
    lock that guards the cache, so a cached lookup never waits for another tenant's compile.

    A spec is checked against `limits` before it is compiled (kvtier.server.decoding.grammarlimits), a
    request waits at most `limits.timeout` s for its grammar, and a compile that every waiting
    request has given up on (past the deadline, or its client gone) is dropped while it still
    queues; one already running ends on its own (xgrammar cannot be interrupted), bounded by
    the limits, and its grammar is kept. Compiled grammars are kept in an LRU of at most
    `limits.cache_bytes` (xgrammar's own measure of each); `metrics.grammar_cache(bytes,
    entries)` is told its size at each change."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: frozenset[int],
        limits: GrammarLimits | None = None,
        metrics: Any = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.limits = limits or GrammarLimits()
        self.metrics = metrics
        # the cache and the compiles under way, never held across a compile (re-entrant: a compile
        # that ends at once runs its done-callback inside `_submit`)
        self._lock = threading.RLock()
        self._making = threading.Lock()  # the compiler, made once (on a compile thread)
        self._compiler: Any = None
        self._compiled: OrderedDict[GrammarSpec, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._flights: dict[GrammarSpec, _Flight] = {}
        self._pool = ThreadPoolExecutor(
            self.limits.threads, thread_name_prefix="kvtier-grammar", initializer=_background
        )

    def _xgr(self) -> Any:
        try:
            import xgrammar
        except ImportError as exc:  # an install without the server's extras
            raise InvalidRequest(
                "structured output needs the xgrammar package: pip install 'kvtier[server]'"
            ) from exc
        return xgrammar

    @property
    def cache_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._compiled)

    def __contains__(self, spec: object) -> bool:
        """Whether `spec`'s compiled grammar is kept."""
        return spec in self._compiled

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (xgrammar.CompiledGrammar), waiting for it here."""
        future = self._submit(spec)
        try:
            return future.result(timeout=self.limits.timeout)
        except concurrent.futures.TimeoutError:
            raise self._late() from None
        finally:
            self._release(spec, future)

    async def compiled(
        self, spec: GrammarSpec, gone: Callable[[], Awaitable[None]] | None = None
    ) -> Any:
        """`compile` for a request on the event loop: its deadline is `limits.timeout`, and
        when `gone()` returns first (its client left) it stops waiting (InvalidRequest)."""
        future = self._submit(spec)
        try:
            if future.done():
                return future.result()
            waiter = asyncio.wrap_future(future)
            watch = asyncio.ensure_future(gone()) if gone is not None else None
            try:
                waits: set[asyncio.Future[Any]] = {waiter} | ({watch} if watch else set())
                await asyncio.wait(
                    waits, timeout=self.limits.timeout, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                if watch is not None:
                    watch.cancel()
            if waiter.done():
                return waiter.result()
            if watch is not None and watch.done():
                raise InvalidRequest("the client closed the connection while its grammar compiled")
            raise self._late()
        finally:
            self._release(spec, future)

    def _late(self) -> InvalidRequest:
        return InvalidRequest(
            f"the response format's grammar did not compile within {self.limits.timeout:g} s "
            "(--grammar-timeout); use a smaller schema (fewer enum values, shorter patterns)"
        )

    def _submit(self, spec: GrammarSpec) -> concurrent.futures.Future[Any]:
        """A future of `spec`'s compiled grammar: done at once from the cache, else the
        compile under way for it, else a new one; the caller `_release`s it."""
        if spec.kind != "json":
            check_schema(spec.schema, self.limits)
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                done: concurrent.futures.Future[Any] = concurrent.futures.Future()
                done.set_result(hit[0])
                return done
            flight = self._flights.get(spec)
            if flight is None:
                flight = _Flight(self._pool.submit(self._build, spec))
                self._flights[spec] = flight
                flight.future.add_done_callback(lambda f: self._landed(spec, f))
            flight.waiters += 1
            return flight.future

    def _release(self, spec: GrammarSpec, future: concurrent.futures.Future[Any]) -> None:
        """A request stops waiting for `future`: the last one cancels it while it queues."""
        with self._lock:
            flight = self._flights.get(spec)
            if flight is None or flight.future is not future:
                return
            flight.waiters -= 1
            if flight.waiters > 0 or not future.cancel():
                return
            self._flights.pop(spec, None)  # (cancel() ran `_landed`, which popped it already)

    def _landed(self, spec: GrammarSpec, future: concurrent.futures.Future[Any]) -> None:
        """A compile ended: keep its grammar in the LRU, evicting the least recent ones."""
        with self._lock:
            if self._flights.get(spec, _NO_FLIGHT).future is future:
                del self._flights[spec]
            if future.cancelled() or future.exception() is not None:
                return
            compiled = future.result()
            size = int(getattr(compiled, "memory_size_bytes", 0)) + len(spec.schema)
            if spec not in self._compiled:
                self._compiled[spec] = (compiled, size)
                self._bytes += size
            while self._bytes > self.limits.cache_bytes and len(self._compiled) > 1:
                _, (_, gone) = self._compiled.popitem(last=False)
                self._bytes -= gone
            size_now, entries = self._bytes, len(self._compiled)
        if self.metrics is not None:
            self.metrics.grammar_cache(size_now, entries)

    def _build(self, spec: GrammarSpec) -> Any:
        """Compile `spec` (on a compile thread)."""
        xgr = self._xgr()
        with self._making:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            return self._compiler.compile_grammar(_grammar(xgr, spec))
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequest(f"the JSON schema cannot be used: {_plain(exc)}") from None

    def matcher(self, compiled: Any) -> Any:
        return self._xgr().GrammarMatcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# The compile threads' nice value: a compile is background work beside the scheduler's steps
# and the event loop, which win the CPU when the host has no core to spare (Linux schedules
# threads as tasks: one thread's nice is its own)
COMPILE_NICE = 10


def _background() -> None:
    """Lower the calling compile thread's CPU priority (where the platform allows it)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)


@dataclass
class _Flight:
    """A compile under way, and how many requests wait for it."""

    future: concurrent.futures.Future[Any]
    waiters: int = 0


_NO_FLIGHT = _Flight(concurrent.futures.Future())
# xgrammar's messages carry where in its sources they were raised ("[12:00:01] /path/x.cc:42:")
_SOURCE = re.compile(r"\[[\d:]+\]\s*|\S*[/\\]\S+\.(?:cc|cpp|h|hpp|py):\d+:?\s*")


def _plain(exc: BaseException) -> str:
    """An xgrammar error's text without its build paths and stack (what a client may read)."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip() and "Stack trace" not in ln]
    text = _SOURCE.sub("", lines[-1] if lines else type(exc).__name__).strip()
    return text[:300] or type(exc).__name__


def _grammar(xgr: Any, spec: GrammarSpec) -> Any:
    if spec.kind == "json":  # OpenAI's json_object: an object, not any JSON value
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "schema":
        return xgr.Grammar.from_json_schema(spec.schema, any_whitespace=False)
    calls = [_call_grammar(xgr, f) for f in json.loads(spec.schema)]
    one = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    if not spec.many:
        return one
    empty = xgr.Grammar.from_ebnf('root ::= ""')
    more = empty
    for _ in range(MAX_PARALLEL_CALLS - 1):
        more = xgr.Grammar.union(empty, xgr.Grammar.concat(_literal(xgr, "\n"), one, more))
    return xgr.Grammar.concat(one, more)


def _call_grammar(xgr: Any, function: dict[str, Any]) -> Any:
    params = function.get("parameters") or {"type": "object"}
    schema = {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return xgr.Grammar.concat(
        _literal(xgr, CALL_OPEN + "\n"), body, _literal(xgr, "\n" + CALL_CLOSE)
    )


def _literal(xgr: Any, text: str) -> Any:
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text))


def apply_masks(
    logits: torch.Tensor,
    rows: list[int],
    matchers: list[Any],
    faults: dict[int, BaseException] | None = None,
) -> None:
    """Mask, in place, what each matcher's grammar forbids in its row of `logits`. A matcher
    that raises is its row's fault alone: with `faults`, the row goes there (row -> exception)
    and the others are masked as usual.

    On the host the bitmask's bits are unpacked by numpy and each row masked in place in one
    fill: xgrammar's own CPU path took 0.49 ms for a 152,064-token row against 0.05 ms so, and
    the host samples a constrained row between two steps of the batch (bench/grammar_step.py).
    On a GPU, xgrammar's kernel."""
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for i, m in enumerate(matchers):
        try:
            m.fill_next_token_bitmask(bitmask, i)
        except Exception as exc:
            if faults is None:
                raise
            faults[rows[i]] = exc
    if logits.device.type != "cpu":
        sub = logits[rows]
        xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device))
        logits[rows] = sub
        return
    forbidden = torch.from_numpy(_unpack_forbidden(bitmask.numpy(), vocab))
    for i, row in enumerate(rows):
        logits[row].masked_fill_(forbidden[i], float("-inf"))


def _unpack_forbidden(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """`[rows, vocab]` booleans, True where xgrammar's bitmask (int32 words, bit `j` of word `w`
    allowing token `32 * w + j`) forbids the token."""
    words = np.ascontiguousarray(bitmask, dtype="<i4")  # the bits' order is little-endian's
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    return bits == 0
