"""Structured output: the grammar a request's reply must follow, compiled with xgrammar.

`spec_of` reads what a request asks for (pure: no xgrammar): `response_format` `json_object` or
`json_schema`, or a tool call that `tool_choice` makes required (`required`, or a named
function) in the hermes format of `kvtier.server.tools`. `GrammarBook` compiles it for one
served model's tokenizer (compiled grammars are cached by their spec), and every constrained
turn gets a `GrammarMatcher` of its own. Each step the batch fills one token bitmask row per
constrained sequence and applies them to the step's logits in one call, on the logits'
device; unconstrained rows are not touched (`kvtier.server.logitproc`).

The JSON the grammar allows has fixed separators (`", "`, `": "`), no free whitespace: the
reply is exactly what `json.dumps` writes, so a tool call's arguments round-trip as text.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.errors import InvalidRequest
from kvtier.server.tools import CALL_CLOSE, CALL_OPEN

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
        return GrammarSpec("schema", json.dumps(schema, sort_keys=True))
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
    """Compiles the grammars of one served model (thread-safe; each spec compiled once)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._compiled: dict[GrammarSpec, Any] = {}

    def _xgr(self) -> Any:
        try:
            import xgrammar
        except ImportError as exc:  # an install without the server's extras
            raise InvalidRequest(
                "structured output needs the xgrammar package: pip install 'kvtier[server]'"
            ) from exc
        return xgrammar

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (xgrammar.CompiledGrammar)."""
        xgr = self._xgr()
        with self._lock:
            if spec in self._compiled:
                return self._compiled[spec]
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            try:
                compiled = self._compiler.compile_grammar(_grammar(xgr, spec))
            except (RuntimeError, ValueError) as exc:
                raise InvalidRequest(f"the JSON schema cannot be used: {exc}") from None
            self._compiled[spec] = compiled
            return compiled

    def matcher(self, compiled: Any) -> Any:
        return self._xgr().GrammarMatcher(compiled)


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
