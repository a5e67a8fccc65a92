"""Tool calling in the hermes format (what Qwen2.5 and the Hermes models use; vLLM's
`--tool-call-parser hermes`).

A request's `tools` are offered to the model in its system message, between `<tools>` tags; the
model calls one by writing `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
`parse_tool_calls` takes such blocks out of a reply. `render_prompt` renders a conversation
through the model's chat template: where the template knows tools itself (its source uses
`tools`), it gets them; else the messages are rewritten in the hermes format first (the tools in
the system message, an assistant's calls as the blocks it wrote, a tool's result as a user
message in `<tool_response>` tags) and rendered as plain messages.

An assistant message's calls render as the exact text the model wrote: the name as JSON, and
the `arguments` string as the client sends it back (the exact JSON text the parser took out of
the reply, never re-serialized). So a tool loop's turn N+1 prompt starts with turn N's prompt
and reply token for token, and it restores from the cache instead of recomputing.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from kvtier.errors import InvalidRequest

PARSERS = ("hermes",)
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the JSON text of the arguments, exactly as the model wrote it
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call["index"] = index
        return call


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (the grammar of `tool_choice: required` produces it)."""
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}\n{CALL_CLOSE}'


# Nesting a call's JSON may have: deeper is not a call (and never reaches the decoder, whose
# recursion a reply of a thousand `[` would exhaust)
MAX_CALL_DEPTH = 64
_WS = " \t\r\n"
_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply: each well-formed `<tool_call>` block becomes a call. A block
    that is not a JSON object with a string `name` and an object `arguments` stays in the
    content, as the model wrote it. Without calls the content is the reply; with calls, it is
    the text between them, each piece without the whitespace that touched a call, the pieces
    that are left joined by newlines. A streamed reply's content (`ContentFilter`) is the same
    text, whatever its deltas."""
    calls: list[ToolCall] = []
    pieces: list[str] = []  # the text between calls (a malformed block is text)
    piece = ""
    pos = 0
    while True:
        start = text.find(CALL_OPEN, pos)
        end = text.find(CALL_CLOSE, start + len(CALL_OPEN)) if start >= 0 else -1
        if start < 0 or end < 0:
            piece += text[pos:]
            break
        call = _call_of(text[start + len(CALL_OPEN) : end])
        if call is None:
            piece += text[pos : end + len(CALL_CLOSE)]
        else:
            pieces.append(piece + text[pos:start])
            piece = ""
            calls.append(call)
        pos = end + len(CALL_CLOSE)
    if not calls:
        return piece, []
    pieces.append(piece)
    last = len(pieces) - 1
    kept = [p.lstrip(_WS) if i else p for i, p in enumerate(pieces)]  # the side after a call
    kept = [p.rstrip(_WS) if i < last else p for i, p in enumerate(kept)]  # before a call
    return "\n".join(p for p in kept if p), calls


def _call_of(block: str) -> ToolCall | None:
    """The call a block's JSON makes, its `arguments` as their own text (the value the JSON
    object keeps: the last of duplicate keys, as any JSON decoder keeps it)."""
    body = block.strip(_WS)
    if not body.startswith("{") or _depth(body) > MAX_CALL_DEPTH:
        return None
    members = _members(body)
    if members is None:
        return None
    name, arguments = members.get("name"), members.get("arguments")
    if name is None or not isinstance(name[0], str):
        return None
    if arguments is None or not isinstance(arguments[0], dict):
        return None
    # the arguments' own text, not a re-serialization: the next turn renders it back verbatim
    return ToolCall(name[0], arguments[1])


def _members(body: str) -> dict[str, tuple[Any, str]] | None:
    """The top-level members of the JSON object `body` (the whole of it), each key's value and
    its text; None when `body` is not one JSON object."""
    out: dict[str, tuple[Any, str]] = {}
    i = _skip(body, 1)
    if i < len(body) and body[i] == "}":
        return out if _skip(body, i + 1) == len(body) else None
    try:
        while True:
            if i >= len(body) or body[i] != '"':
                return None
            key, i = _DECODER.raw_decode(body, i)
            i = _skip(body, i)
            if i >= len(body) or body[i] != ":":
                return None
            start = _skip(body, i + 1)
            value, end = _DECODER.raw_decode(body, start)
            out[key] = (value, body[start:end])
            i = _skip(body, end)
            if i < len(body) and body[i] == ",":
                i = _skip(body, i + 1)
                continue
            if i < len(body) and body[i] == "}":
                return out if _skip(body, i + 1) == len(body) else None
            return None
    except (ValueError, RecursionError):
        return None


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON `text` (brackets inside strings are
    text)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


class ContentFilter:
    """The content deltas of a streamed reply that may call tools. Text is sent as it comes,
    but for what may still belong to a call: from a `<tool_call>` on (or the start of one),
    and the whitespace at the end (which a call after it takes out). At the end, the rest of
    the content that `parse_tool_calls` finds in the whole reply, and the calls."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.calling = False

    def add(self, delta: str) -> str:
        self.text += delta
        if self.calling:
            return ""
        at = self.text.find(CALL_OPEN, self.sent)
        if at >= 0:
            self.calling = True
            ready = at
        else:
            ready = len(self.text)
            for k in range(min(len(CALL_OPEN) - 1, len(self.text)), 0, -1):
                if CALL_OPEN.startswith(self.text[-k:]):
                    ready -= k
                    break
        ready = len(self.text[:ready].rstrip(_WS))
        out = self.text[self.sent : ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not yet sent, the calls) once the reply has ended."""
        content, calls = parse_tool_calls(self.text)
        # what was sent is the start of the content: text before any block, up to its last
        # character that is not whitespace, which no block's removal takes out
        return content[self.sent :], calls


def template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def render_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str:
    """The prompt of a conversation (OpenAI messages: `tool_calls`, `tool` results), with the
    generation prompt. Raises InvalidRequest when the template cannot render it."""
    try:
        if template_knows_tools(tokenizer) and (tools or _has_tool_turns(messages)):
            hf = [_hf_message(m) for m in messages]
            out = tokenizer.apply_chat_template(
                hf, tools=tools, add_generation_prompt=True, tokenize=False
            )
        else:
            plain = hermes_messages(messages, tools)
            out = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    except InvalidRequest:
        raise
    except Exception as exc:
        raise InvalidRequest(f"messages cannot be rendered by the chat template: {exc}") from None
    return str(out)


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def _hf_message(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {"name": c["name"], "arguments": _arguments(c["arguments"])},
            }
            for c in m["tool_calls"]
        ]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, str]]:
    """Plain role/content messages in the hermes format, for a template without tools."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if m.get("tool_calls"):
            _arguments_all(m["tool_calls"])
            calls = "\n".join(call_text(c["name"], c["arguments"]) for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        block = TOOLS_PREAMBLE
        block += "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FORMAT
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _arguments_all(calls: list[dict[str, Any]]) -> None:
    for c in calls:
        _arguments(c["arguments"])


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"tool call {text[:60]!r}: `function.arguments` must be the JSON text of an object, "
            "as the server returned it"
        )
    return value
