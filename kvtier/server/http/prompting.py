"""A request's prompt as token ids: rendered and tokenized in a worker thread, after a bound on
its characters that refuses a prompt far past the context without tokenizing it at all.

Tokenizing runs for seconds on a body of megabytes (a 4 MiB prompt: 3.4 s with the built-in
byte tokenizer), and on the event loop that held every other request, `/healthz` too. The
bound: a token stands for at most `token_chars` characters of the text the tokenizer sees, the
longest entry of its vocabulary with its added and special tokens (a byte-level BPE entry has a
character per byte, and a character is at least a byte; a SentencePiece entry a character per
character, its byte fallback `<0xNN>` six for one byte). The tokenizer's normalizer may shorten
the text first: Unicode composition folds at most three code points into one (Hangul jamo), so
NORMALIZE_SLACK is 4. A prompt of more than context x token_chars x NORMALIZE_SLACK characters
therefore has more tokens than the context holds, and is refused with the same 400 as one
counted. (The built-in model: 8,192 x 7 x 4 = 229,376 characters.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvtier.errors import InvalidRequest
from kvtier.server.decoding.tools import render_prompt
from kvtier.server.http.common import ApiError

NORMALIZE_SLACK = 4


def token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` stands for; 0 when its vocabulary cannot be
    read (then no prompt is refused before it is counted)."""
    try:
        vocab = tokenizer.get_vocab()
        return max((len(str(entry)) for entry in vocab), default=0)
    except Exception:
        return 0


def max_prompt_chars(served: Any) -> int:
    """The characters past which a prompt cannot fit `served`'s context; 0: no bound."""
    chars = getattr(served, "token_chars", -1)
    if chars < 0:  # not worked out yet (a scan of the vocabulary, once)
        chars = served.token_chars = token_chars(served.tokenizer)
    return int(served.context_tokens * chars * NORMALIZE_SLACK)


def _check_chars(served: Any, text: str, param: str) -> None:
    bound = max_prompt_chars(served)
    if bound and len(text) > bound:
        raise ApiError(
            400,
            f"the prompt has {len(text)} characters, more than the model's context of "
            f"{served.context_tokens} tokens can hold; shorten the conversation (drop or "
            "summarise old turns)",
            param=param,
            code="context_length_exceeded",
        )


def _chat(
    served: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    tok = served.tokenizer
    try:
        prompt = render_prompt(tok, messages, tools)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param="messages") from None
    _check_chars(served, prompt, "messages")
    return list(tok.encode(prompt, add_special_tokens=False))


def _completion(served: Any, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):  # token ids, sent as they are (the context check follows)
        if not prompt:
            raise ApiError(400, "the prompt holds no token ids; send at least one", param="prompt")
        return list(prompt)
    _check_chars(served, prompt, "prompt")
    return list(served.tokenizer.encode(prompt, add_special_tokens=True))


async def chat_ids(
    served: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The chat prompt's token ids, rendered by the chat template (with `tools`, in the hermes
    format where the template has none: kvtier.server.decoding.tools); ApiError 400 when the template
    refuses the messages or they are far longer than the context."""
    return await asyncio.to_thread(_chat, served, messages, tools)


async def completion_ids(served: Any, prompt: str | list[int]) -> list[int]:
    """The completion prompt's token ids (given as ids: those); ApiError 400 when it is far
    longer than the context."""
    return await asyncio.to_thread(_completion, served, prompt)
