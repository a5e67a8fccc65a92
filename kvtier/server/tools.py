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


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply: each well-formed `<tool_call>` block becomes a call, the text
    outside the blocks the content. A block that is not a JSON object with a string `name`
    and an object `arguments` stays in the content, as the model wrote it."""
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(CALL_OPEN, pos)
        end = text.find(CALL_CLOSE, start + len(CALL_OPEN)) if start >= 0 else -1
        if start < 0 or end < 0:
            content.append(text[pos:])
            break
        call = _call_of(text[start + len(CALL_OPEN) : end])
        if call is None:
            content.append(text[pos : end + len(CALL_CLOSE)])
        else:
            content.append(text[pos:start])
            calls.append(call)
        pos = end + len(CALL_CLOSE)
    out = "".join(content)
    return (out.strip() if calls else out), calls


def _call_of(block: str) -> ToolCall | None:
    body = block.strip()
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if not isinstance(obj.get("arguments"), dict):
        return None
    # the arguments' own text, not a re-serialization: the next turn renders it back verbatim
    key = body.find('"arguments"')
    colon = body.find(":", key + len('"arguments"'))
    start = colon + 1
    while body[start] in " \t\r\n":
        start += 1
    try:
        _value, end = json.JSONDecoder().raw_decode(body, start)
    except ValueError:
        return None
    return ToolCall(obj["name"], body[start:end])


class ContentFilter:
    """The content deltas of a streamed reply that may call tools: text is held back from the
    first `<tool_call>` on (and while it may still become one); the calls come at the end."""

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
            out, self.sent = self.text[self.sent : at], at
            return out
        ready = len(self.text)
        for k in range(min(len(CALL_OPEN) - 1, len(self.text)), 0, -1):
            if CALL_OPEN.startswith(self.text[-k:]):
                ready -= k
                break
        out = self.text[self.sent : ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not yet sent, the calls) once the reply has ended."""
        _, calls = parse_tool_calls(self.text)
        if calls:
            return "", calls  # the content before the first call was sent already
        return self.text[self.sent :], []


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
