"""A chat or text completion from its validated body to its response: the job (with the turn's
grammar, penalties and logprobs), its admission, and the reply, whole or streamed as SSE.

The routes (kvtier.server.http.app) read the body and tokenize the prompt; `respond` does the rest.
A chat request that offers `tools` gets the hermes tool-call parser (`--tool-call-parser`):
`message.tool_calls` or streamed `delta.tool_calls`, `finish_reason` "tool_calls"
(kvtier.server.http.replies, kvtier.server.decoding.tools).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.errors import InvalidRequest, KvtierError, L1BudgetExceeded
from kvtier.server.batch.engine import Engine
from kvtier.server.batch.jobs import (
    ContextExceeded,
    Delta,
    Draining,
    Finished,
    Job,
    Overloaded,
    Stream,
    check_fits,
)
from kvtier.server.config import ServerConfig
from kvtier.server.decoding.grammar import GrammarBook, spec_of
from kvtier.server.decoding.grammarlimits import GrammarLimits
from kvtier.server.http.auth import tenant_of
from kvtier.server.http.clientgone import until_gone, watch
from kvtier.server.http.common import MAX_SESSION_ID, ApiError, check_id
from kvtier.server.http.devices_admin import DegradedTurn
from kvtier.server.http.replies import Reply
from kvtier.server.warm_request import is_warm_up

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.http.state import RoutePort

SOURCE_HEADER = "X-Kvtier-Restore-Source"


def grammar_book(
    served: Any, config: ServerConfig | None = None, metrics: Any = None
) -> GrammarBook:
    """The served model's grammar compiler, made on first use (with `config`'s limits)."""
    if served.grammars is None:
        vocab = int(getattr(served.model.config, "vocab_size", 0) or len(served.tokenizer))
        limits = GrammarLimits.from_config(config) if config is not None else None
        served.grammars = GrammarBook(served.tokenizer, vocab, served.eos_ids, limits, metrics)
    return served.grammars  # type: ignore[no-any-return]


async def grammar_of(state: RoutePort, request: Request, served: Any, body: Any) -> Any:
    """A new matcher per turn for the grammar the request asks for, or None (compiled on the
    grammar book's own threads, within its limits and deadline; given up when the client
    leaves)."""
    if not hasattr(body, "response_format"):
        return None
    try:
        spec = spec_of(
            body.format_dict(), body.tool_list(), body.choice(), body.parallel_tool_calls
        )
        if spec is None:
            return None
        if body.ignore_eos:
            # the grammar ends the reply with the end token once its JSON is whole; past it
            # nothing would constrain the tokens, and the reply would no longer parse
            raise ApiError(
                400,
                "ignore_eos cannot be combined with response_format or a required tool call "
                "(tool_choice): the grammar decides where such a reply ends; send one of them",
                param="ignore_eos",
            )
        book = grammar_book(served, state.config, state.metrics)
        compiled = await book.compiled(spec, lambda: until_gone(request))
    except InvalidRequest as exc:
        param = "response_format" if body.response_format is not None else "tool_choice"
        raise ApiError(400, str(exc), param=param) from None
    return lambda: book.matcher(compiled)


async def respond(
    state: RoutePort,
    request: Request,
    engine: Engine,
    body: Any,
    ids: list[int],
    max_tokens: int | None,
    chat: bool,
) -> Response:
    cfg = state.config
    param = "messages" if chat else "prompt"
    sid = request.headers.get("x-session-id")
    if not sid and body.user:
        sid = check_id(body.user, "user", MAX_SESSION_ID)
    tenant = tenant_of(request)
    ephemeral = not sid
    sid = check_id(sid, "X-Session-ID", MAX_SESSION_ID) if sid else f"anon-{uuid.uuid4().hex}"
    try:  # an id past the model's embeddings never reaches it (on CUDA: a device fault)
        engine.served.check_ids(ids)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=param) from None
    try:
        max_tokens = check_fits(engine.served, cfg, len(ids), max_tokens)
    except ContextExceeded as exc:
        raise ApiError(400, str(exc), param=param, code="context_length_exceeded") from None
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param="max_tokens") from None
    job = Job(
        sid,
        tenant,
        tuple(ids),
        max_tokens,
        body.temperature,
        body.top_p,
        body.seed,
        body.stops(),
        ephemeral,
        body.ignore_eos,
        internal=is_warm_up(request.scope),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logprobs=body.top(),
        grammar=await grammar_of(state, request, engine.served, body),
    )
    stream = await _start(engine, job)
    started = stream.started
    assert started is not None
    turn = DegradedTurn(engine.served.devices, stream.streaming, state.metrics, stream)
    headers = {
        **turn.headers(),
        SOURCE_HEADER: started.source,
        "X-Kvtier-Cached-Tokens": str(started.cached_tokens),
        "X-Session-ID": sid,
    }
    tools = chat and cfg.tool_call_parser != "none" and bool(body.tool_list())
    reply = Reply(engine.served.tokenizer, chat, tools, job.logprobs is not None)
    shape = _Shape(chat, cfg.served_model_name, sid, turn, stream)
    if not body.stream:
        return await _whole(request, stream, reply, shape, headers)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(
        _events(stream, reply, shape, include_usage),
        media_type="text/event-stream",
        headers={**headers, "Cache-Control": "no-cache"},
    )


async def _start(engine: Engine, job: Job) -> Stream:
    try:
        return await engine.start(job)
    except Overloaded as exc:
        raise ApiError(
            429,
            str(exc),
            "rate_limit_error",
            code="overloaded",
            headers={"Retry-After": str(exc.retry_after)},
        ) from None
    except Draining as exc:
        raise ApiError(503, str(exc), "server_error") from None
    except L1BudgetExceeded as exc:  # too many long sessions at once: transient, retry
        raise ApiError(
            503,
            f"L1BudgetExceeded: {exc}",
            "server_error",
            code="l1_full",
            headers={"Retry-After": "1"},
        ) from None
    except KvtierError as exc:
        raise ApiError(500, f"{type(exc).__name__}: {exc}", "server_error") from None


class _Shape:
    """What every response object of one turn carries: its id, times and usage."""

    def __init__(
        self, chat: bool, model: str, sid: str, turn: DegradedTurn, stream: Stream
    ) -> None:
        self.chat, self.model, self.sid, self.turn, self.stream = chat, model, sid, turn, stream
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def wrap(self, obj: str, choices: list[Any], **more: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **more,
        }

    def usage(self, done: Finished) -> dict[str, Any]:
        return {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
            "kvtier": {
                "restore_source": done.source,
                "session_id": self.sid,
                "degraded": self.turn.degraded,
                # the turn attended over sinks + a window (a device lost: degraded mode)
                "windowed_attention": self.stream.streaming is not None,
                "degraded_kv": self.turn.kv,
            },
        }


async def _whole(
    request: Request, stream: Stream, reply: Reply, shape: _Shape, headers: dict[str, str]
) -> Response:
    done: Finished | None = None
    gone = watch(request, stream.cancel)  # the client left: stop, as a stream does
    try:
        async for event in stream.events():
            if isinstance(event, Delta):
                reply.add(event.text, event.logprobs)
            else:
                done = event
    finally:
        gone.cancel()
        if done is None:
            stream.cancel()
    assert done is not None
    shape.turn.finished()
    choice: dict[str, Any] = {"index": 0}
    if shape.chat:
        choice["message"] = reply.message()
    else:
        choice["text"] = reply.text()
    choice["finish_reason"] = reply.finish_reason(done.finish_reason)
    choice["logprobs"] = reply.all_logprobs()
    obj = "chat.completion" if shape.chat else "text_completion"
    return JSONResponse(shape.wrap(obj, [choice], usage=shape.usage(done)), headers=headers)


def _chunk(shape: _Shape, delta: dict[str, Any] | str | None, finish: str | None, lp: Any) -> str:
    if shape.chat:
        c: dict[str, Any] = {"index": 0, "delta": delta or {}, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        c = {"index": 0, "text": delta or "", "finish_reason": finish}
        obj = "text_completion"
    c["logprobs"] = lp
    return _sse(shape.wrap(obj, [c]))


async def _events(
    stream: Stream, reply: Reply, shape: _Shape, include_usage: bool
) -> AsyncIterator[str]:
    finished = False
    chat = shape.chat
    try:
        if chat:
            yield _chunk(shape, {"role": "assistant", "content": ""}, None, None)
        async for event in stream.events():
            if isinstance(event, Delta):
                text, lp = reply.add(event.text, event.logprobs)
                if text or lp is not None:
                    yield _chunk(shape, {"content": text} if chat else text, None, lp)
                continue
            shape.turn.finished()
            rest = reply.end()
            if rest:
                yield _chunk(shape, {"content": rest} if chat else rest, None, None)
            if reply.calls:
                calls = [c.to_openai(index=i) for i, c in enumerate(reply.calls)]
                yield _chunk(shape, {"tool_calls": calls}, None, None)
            reason = reply.finish_reason(event.finish_reason)
            yield _chunk(shape, None if chat else "", reason, None)
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse(shape.wrap(obj, [], usage=shape.usage(event)))
        finished = True
        yield "data: [DONE]\n\n"
    except Exception as exc:  # headers are sent: report in-band, as OpenAI does
        err = {
            "message": f"{type(exc).__name__}: {exc}",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        yield _sse({"error": err})
        yield "data: [DONE]\n\n"  # the stream ends as every stream does: clients stop reading
    finally:
        if not finished:
            stream.cancel()  # the client went away: stop, keep what is committed


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
