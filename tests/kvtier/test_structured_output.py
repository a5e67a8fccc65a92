"""Structured output, tool calls, logprobs and penalties on the batch scheduler (CPU, random
weights): a grammar-constrained reply is valid JSON of its schema however random the model,
while unconstrained sessions in the same steps get exactly the replies they get alone."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from test_batching import _build, _config, _greedy_alone, _job, _one, _prompts, _run

from kvtier.errors import InvalidRequest
from kvtier.server.backend import RecomputeBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.decoding.grammar import GrammarBook, spec_of
from kvtier.server.decoding.tools import call_text, hermes_messages, parse_tool_calls, render_prompt

xgrammar = pytest.importorskip("xgrammar")

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "number"}},
        "required": ["ok", "n"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 4}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "inner": {
                "type": "object",
                "properties": {"k": {"type": "integer"}, "v": {"enum": [1, 2, 3]}},
                "required": ["k", "v"],
            }
        },
        "required": ["inner"],
    },
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["name"],
    },
    {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "required": ["x", "y"],
                },
                "maxItems": 3,
            }
        },
        "required": ["points"],
    },
    {"type": "object", "properties": {"level": {"const": "high"}}, "required": ["level"]},
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99},
            "kind": {"enum": ["a", "b"]},
            "note": {"type": ["string", "null"], "maxLength": 8},
        },
        "required": ["id", "kind", "note"],
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"enum": [0, 1]}, "maxItems": 2},
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
    },
]


def _valid(value: Any, schema: dict[str, Any]) -> bool:
    """A small validator of the schema features above (enough to fail a wrong reply)."""
    if "const" in schema:
        return bool(value == schema["const"])
    if "enum" in schema:
        return value in schema["enum"]
    kinds = schema.get("type")
    if isinstance(kinds, list):
        return any(_valid(value, {**schema, "type": k}) for k in kinds)
    if kinds == "null":
        return value is None
    if kinds == "object":
        if not isinstance(value, dict):
            return False
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        return all(_valid(v, props[k]) for k, v in value.items() if k in props)
    if kinds == "array":
        items = schema.get("items", {})
        ok = isinstance(value, list) and len(value) <= schema.get("maxItems", 10**9)
        return ok and all(_valid(v, items) for v in value)
    if kinds == "integer":
        lo, hi = schema.get("minimum", -math.inf), schema.get("maximum", math.inf)
        return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
    if kinds == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kinds == "boolean":
        return isinstance(value, bool)
    if kinds == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 10**9)
    return True


def _grammar_job(book: GrammarBook, sid: str, prompt: list[int], schema: dict[str, Any]) -> Any:
    spec = spec_of({"type": "json_schema", "json_schema": {"schema": schema}}, None, None, True)
    assert spec is not None
    compiled = book.compile(spec)
    return _job(sid, prompt, 400, grammar=lambda: book.matcher(compiled))


def test_ten_schemas_batched_with_unconstrained_sessions(tmp_path: Path) -> None:
    """10 constrained sessions (sampled) and 3 unconstrained ones (greedy) in the same steps:
    every constrained reply parses as JSON of its schema and ends with the end token; the
    unconstrained replies equal each session's reply alone."""
    ref = _build("llama")
    served = _build("llama")
    book = GrammarBook(served.tokenizer, served.model.config.vocab_size, served.eos_ids)
    sched = BatchScheduler(served, RecomputeBackend(served.model), _config(tmp_path))
    try:
        prompts = _prompts(7, [30] * 13)
        jobs = [_grammar_job(book, f"g{i}", prompts[i], s) for i, s in enumerate(SCHEMAS)]
        for i, j in enumerate(jobs):  # sampled: a random model's greedy digits never end
            j.temperature, j.seed = 1.0, 11 + i
        plain = [_job(f"p{i}", prompts[10 + i], 20) for i in range(3)]
        results = _run(sched, *(_one(sched, j) for j in jobs + plain))
        for schema, r in zip(SCHEMAS, results[:10], strict=True):
            assert r.finished.finish_reason == "stop", r.text
            assert _valid(json.loads(r.text), schema), (r.text, schema)
        for p, r in zip(prompts[10:], results[10:], strict=True):
            assert r.text == _greedy_alone(ref, p, 20)
    finally:
        sched.close()


def test_a_required_tool_call_is_a_parsable_call_of_an_offered_tool(tmp_path: Path) -> None:
    served = _build("qwen2")
    book = GrammarBook(served.tokenizer, served.model.config.vocab_size, served.eos_ids)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "required": ["x", "y"],
                },
            },
        },
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
    ]
    sched = BatchScheduler(served, RecomputeBackend(served.model), _config(tmp_path))
    try:
        for choice, names in (("required", {"add", "noop"}), (_named("add"), {"add"})):
            spec = spec_of(None, tools, choice, parallel_tool_calls=False)
            assert spec is not None
            compiled = book.compile(spec)
            job = _job("t", _prompts(3, [40])[0], 300, grammar=lambda c=compiled: book.matcher(c))
            job.temperature, job.seed = 1.0, 5
            (r,) = _run(sched, _one(sched, job))
            content, calls = parse_tool_calls(r.text)
            assert content == "" and len(calls) == 1, r.text
            assert calls[0].name in names
            assert isinstance(json.loads(calls[0].arguments), dict)
            assert call_text(calls[0].name, calls[0].arguments) == r.text  # renders back exactly
    finally:
        sched.close()


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def test_logprobs_and_penalties_in_the_batch(tmp_path: Path) -> None:
    """Logprobs come with every token, the drawn token's is the top one under greedy, and a
    strong frequency penalty changes a greedy reply that repeats itself."""
    served = _build("llama")
    sched = BatchScheduler(served, RecomputeBackend(served.model), _config(tmp_path))
    try:
        prompt = _prompts(5, [24])[0]
        events: list[Any] = []

        async def collect() -> None:
            import asyncio
            import time

            from kvtier.server.batch.jobs import Delta, Finished, Stream

            stream = Stream(asyncio.get_running_loop())
            job = _job("lp", prompt, 12, logprobs=3)
            done = asyncio.wrap_future(sched.submit(job, stream, time.perf_counter()))
            async for e in stream.events():
                if isinstance(e, Delta | Finished):
                    events.append(e)
            await done

        _run(sched, collect())
        entries = [x for e in events if getattr(e, "logprobs", None) for x in e.logprobs]
        assert len(entries) == 12
        for e in entries:
            assert len(e.top) == 3 and e.top[0][0] == e.token
            assert e.logprob == pytest.approx(e.top[0][1]) and e.logprob <= 0
        plain, penal = _run(
            sched,
            _one(sched, _job("a", prompt, 40)),
            _one(sched, _job("b", prompt, 40, frequency_penalty=2.0, presence_penalty=2.0)),
        )
        assert plain.text != penal.text
        counts = [penal.text.count(c) for c in set(penal.text)]
        assert max(counts) <= max(plain.text.count(c) for c in set(plain.text))
    finally:
        sched.close()


def test_bad_grammar_requests_are_typed_errors() -> None:
    with pytest.raises(InvalidRequest, match="needs `tools`"):
        spec_of(None, None, "required", True)
    with pytest.raises(InvalidRequest, match="not in `tools`"):
        spec_of(None, [{"type": "function", "function": {"name": "a"}}], _named("b"), True)
    with pytest.raises(InvalidRequest, match=r"json_schema\.schema"):
        spec_of({"type": "json_schema", "json_schema": {"name": "x"}}, None, None, True)
    served = _build("llama")
    book = GrammarBook(served.tokenizer, served.model.config.vocab_size, served.eos_ids)
    spec = spec_of({"type": "json_schema", "json_schema": {"schema": {"type": 7}}}, None, None, 1)
    assert spec is not None
    with pytest.raises(InvalidRequest, match="cannot be used"):
        book.compile(spec)


def test_hermes_rendering_keeps_each_turn_a_prefix_of_the_next() -> None:
    """Turn N's prompt + the model's reply (a tool call) + the end token is where turn N+1's
    prompt starts, with the tool result after it: the tool loop restores from the cache."""
    tok = _build("llama").tokenizer
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "go"},
    ]
    prompt = render_prompt(tok, messages, tools)
    reply = call_text("f", '{"q": "caf\\u00e9", "n": [1, 2]}')
    _, calls = parse_tool_calls(reply)
    messages.append(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "name": "f", "arguments": calls[0].arguments}],
        }
    )
    messages.append({"role": "tool", "tool_call_id": "c1", "content": '{"r": 1}'})
    nxt = render_prompt(tok, messages, tools)
    assert nxt.startswith(prompt + reply + tok.eos_token)
    assert "<tool_response>" in nxt[len(prompt) :]
    plain = hermes_messages(messages[:2], tools)
    assert plain[0]["content"].startswith("be brief\n\n# Tools")
    with pytest.raises(InvalidRequest, match="arguments"):
        hermes_messages(
            [{"role": "assistant", "tool_calls": [{"name": "f", "arguments": "["}]}], None
        )


@pytest.mark.parametrize("vocab", [257, 1000, 152_064])
def test_host_masks_equal_xgrammars_own(vocab: int) -> None:
    """The host path of apply_masks (numpy unpacks the bitmask) masks exactly the tokens that
    xgrammar's own CPU path masks: several matchers at different points of their grammars,
    a vocabulary not a multiple of 32, rows not in order, an unmasked row left as it was."""
    import torch
    import xgrammar as xgr

    from kvtier.server.decoding.grammar import GrammarSpec, apply_masks
    from kvtier.server.devices.model import byte_tokenizer

    book = GrammarBook(byte_tokenizer(), vocab, frozenset([256]))
    matchers = []
    for text in ('{"a": [1, ', '{"b": "x', ""):
        m = book.matcher(book.compile(GrammarSpec("json")))
        for b in text.encode():
            assert m.accept_token(b)
        matchers.append(m)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab))
    want = logits.clone()
    rows = [3, 0, 1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(bitmask, i)
    sub = want[rows]
    xgr.apply_token_bitmask_inplace(sub, bitmask)
    want[rows] = sub
    apply_masks(logits, rows, matchers)
    assert torch.equal(logits, want)
    assert torch.isinf(logits[rows]).any(-1).all()  # each grammar forbids some tokens
    assert torch.isfinite(logits[2]).all()
