"""A reply as the OpenAI API shows it: its message (content, or tool calls parsed out of it), its
logprobs, and its stream of chunks.

`Reply` gathers the turn's deltas (`kvtier.server.batch.jobs.Delta`). For a chat request that offers
tools (and a `--tool-call-parser`), the text from the first `<tool_call>` on is held back and
the calls come as `tool_calls`, with `finish_reason` "tool_calls" (`kvtier.server.decoding.tools`).
Logprobs come in OpenAI's two shapes: per token with `top_logprobs` (chat), or the legacy
columns (completions).
"""

from __future__ import annotations

from typing import Any

from kvtier.server.decoding.logitproc import TokenLogprob
from kvtier.server.decoding.tools import ContentFilter, ToolCall, parse_tool_calls
from kvtier.server.devices.model import bytes_to_unicode


class Reply:
    """One turn's reply as it arrives (`add`) and when it has ended (`message`, `finish`)."""

    def __init__(self, tokenizer: Any, chat: bool, tools: bool, logprobs: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.filter = ContentFilter() if tools else None
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self.parts: list[str] = []
        self.calls: list[ToolCall] = []
        self.offset = 0  # characters of the text before the current delta (completions)

    def add(self, text: str, logprobs: list[TokenLogprob] | None) -> tuple[str, Any]:
        """A delta: (the content to stream now, its logprobs in the request's shape or None)."""
        self.parts.append(text)
        shown = self.filter.add(text) if self.filter is not None else text
        lp = None
        if self.logprobs is not None and logprobs:
            self.logprobs.extend(logprobs)
            lp = self.logprobs_of(logprobs, self.offset)
        self.offset += len(text)
        return shown, lp

    def end(self) -> str:
        """The content still held back once the reply has ended; the calls go to `calls`."""
        if self.filter is None:
            return ""
        rest, self.calls = self.filter.finish()
        return rest

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self) -> dict[str, Any]:
        """The non-streamed chat message."""
        text = "".join(self.parts)
        if self.filter is not None:
            content, self.calls = parse_tool_calls(text)
        else:
            content = text
        msg: dict[str, Any] = {"role": "assistant", "content": content or None}
        if self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
        else:
            msg["content"] = content
        return msg

    def text(self) -> str:
        return "".join(self.parts)

    def all_logprobs(self) -> Any:
        return None if self.logprobs is None else self.logprobs_of(self.logprobs, 0)

    def logprobs_of(self, entries: list[TokenLogprob], offset: int) -> Any:
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens = [self._token(e.token) for e in entries]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token(i): lp for i, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _chat_entry(self, e: TokenLogprob) -> dict[str, Any]:
        token = self._token(e.token)
        return {
            "token": token,
            "logprob": e.logprob,
            "bytes": list(self._bytes(e.token)),
            "top_logprobs": [
                {"token": self._token(i), "logprob": lp, "bytes": list(self._bytes(i))}
                for i, lp in e.top
            ],
        }

    def _token(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def _bytes(self, token: int) -> bytes:
        """The token's own bytes: a byte-level token's byte even where it is part of a
        character (its decoded text would be U+FFFD)."""
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str) and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return self._token(token).encode("utf-8", "surrogatepass")


# GPT-2's byte-level alphabet, back to bytes
_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}
