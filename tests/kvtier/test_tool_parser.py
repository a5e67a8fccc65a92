"""The hermes tool-call parser: a real JSON decoder with a depth bound, the arguments of the
object's own `arguments` member, and streamed output equal to non-streamed output for any
reply, however it is cut into deltas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.server.decoding.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    MAX_CALL_DEPTH,
    ContentFilter,
    call_text,
    parse_tool_calls,
)
from kvtier.server.http.schema import ChatRequest

CALL = call_text("f", '{"a": 1}')


def test_a_deeply_nested_block_is_text_not_a_recursion_error() -> None:
    reply = CALL_OPEN + "[" * 1000
    assert parse_tool_calls(reply) == (reply, [])
    deep = CALL_OPEN + '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}" + CALL_CLOSE
    assert parse_tool_calls(deep) == (deep, [])
    nested = '{"x": ' * (MAX_CALL_DEPTH - 2) + "1" + "}" * (MAX_CALL_DEPTH - 2)
    ok = call_text("f", '{"n": ' + nested + "}")
    assert parse_tool_calls(ok)[1][0].arguments == '{"n": ' + nested + "}"


@pytest.mark.parametrize(
    "body, arguments",
    [
        ('{"name": "f", "arguments": {"a": 5}, "arguments": {"b": [1]}}', '{"b": [1]}'),
        ('{"note": "arguments", "name": "f", "arguments": {"a": 1}}', '{"a": 1}'),
        (
            '{"name": "arguments", "arguments" : {"x": "\\"arguments\\": 5"}}',
            '{"x": "\\"arguments\\": 5"}',
        ),
    ],
)
def test_the_arguments_are_the_objects_own_member(body: str, arguments: str) -> None:
    content, calls = parse_tool_calls(f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}")
    assert content == "" and len(calls) == 1
    assert calls[0].arguments == arguments
    assert json.loads(calls[0].arguments) == json.loads(body)["arguments"]


def test_an_arguments_member_that_is_not_an_object_is_no_call() -> None:
    for body in ('{"name": "f", "arguments": {"a": 1}, "arguments": 5}', '{"name": "f"}'):
        reply = f"{CALL_OPEN}{body}{CALL_CLOSE}"
        assert parse_tool_calls(reply) == (reply, [])


def test_required_tool_choice_needs_object_parameters() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [tool]}
    with pytest.raises(ValueError, match="JSON Schema of an object"):
        ChatRequest.model_validate({**body, "tool_choice": "required"})


def _streamed(reply: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    f = ContentFilter()
    out, last = "", 0
    for cut in [*sorted({c % (len(reply) + 1) for c in cuts}), len(reply)]:
        out += f.add(reply[last:cut])
        last = cut
    rest, calls = f.finish()
    return out + rest, [(c.name, c.arguments) for c in calls]


PIECES = [CALL_OPEN, CALL_CLOSE, CALL, "\n", " ", "hi", "<tool", "{", "}", '"arguments"', "[", "x"]


@settings(max_examples=3000, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=14),
    st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_streamed_output_equals_non_streamed_output(pieces: list[str], cuts: list[int]) -> None:
    reply = "".join(pieces)
    content, calls = parse_tool_calls(reply)
    assert _streamed(reply, cuts) == (content, [(c.name, c.arguments) for c in calls])


def test_text_after_a_call_is_streamed_too() -> None:
    reply = f"Let me look.\n{CALL}\nDone: see above."
    content, calls = parse_tool_calls(reply)
    assert content == "Let me look.\nDone: see above." and len(calls) == 1
    assert _streamed(reply, [3, 15, 40])[0] == content
