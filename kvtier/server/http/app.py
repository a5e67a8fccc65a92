"""The FastAPI application: OpenAI-compatible endpoints, health, metrics and session admin."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier import __version__
from kvtier.errors import (
    BudgetError,
    ConfigError,
    EncryptionError,
    StoreError,
)
from kvtier.server.backend import make_backend
from kvtier.server.batch.engine import Engine
from kvtier.server.batch.replicas import build_replicas, replica_devices
from kvtier.server.config import ServerConfig
from kvtier.server.devices.devicefault import DeviceFault, is_fatal_device_error
from kvtier.server.devices.failover import place_configured
from kvtier.server.devices.memplan import (
    backend_device_bytes,
    build_plan,
    planned_config,
    startup_peaks,
)
from kvtier.server.devices.model import ServedModel, build_default, load_dummy, load_local
from kvtier.server.http.admin import install_admin_routes
from kvtier.server.http.auth import authenticate
from kvtier.server.http.common import ApiError
from kvtier.server.http.completions import respond
from kvtier.server.http.devices_admin import device_readiness, install_device_routes
from kvtier.server.http.prompting import chat_ids, completion_ids
from kvtier.server.http.requestbody import read_body
from kvtier.server.http.schema import ChatRequest, CompletionRequest
from kvtier.server.http.state import RoutePort, State
from kvtier.server.reqmetrics import RequestMetrics
from kvtier.server.warm_request import warm_request

log = logging.getLogger("kvtier.server")


def _load(config: ServerConfig) -> ServedModel:
    from kvtier.integrations.hf import set_cudnn_attention

    # before the first forward: SDPA picks its backend per call, and cuDNN's builds a plan for
    # every new sequence length, which a cache-served session meets at almost every call
    set_cudnn_attention(config.cudnn_attention)
    if config.model is None:
        return build_default(config.device, seed=config.seed)
    if config.load_format == "dummy":
        return load_dummy(config.model, config.device, seed=config.seed)
    return load_local(config.model, config.device)


def _warm_up(served: ServedModel) -> None:
    """One short forward before reporting ready: kernel loads and library handles are created
    here, so the first client request after a restart does not pay for them."""
    import torch

    ids = torch.arange(8, device=served.device).unsqueeze(0) % served.vocab_size
    with torch.inference_mode():
        served.model(input_ids=ids)
    if served.device.type == "cuda":
        torch.cuda.synchronize(served.device)
    # A request's own first-use costs, paid here rather than by the first client: the chat
    # template is compiled (jinja) at its first render, the request model at its first
    # validation. (On a GPU host the first request after a restart took 34 ms where the same
    # kind of request took 10 ms later, with the same restore decision.)
    body = {"model": "default", "messages": [{"role": "user", "content": "warm-up"}]}
    chat = ChatRequest.model_validate(body)
    messages = [{"role": m.role, "content": m.text()} for m in chat.messages]
    with contextlib.suppress(Exception):  # a template that cannot render says so per request
        prompt = served.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        served.tokenizer.encode(prompt, add_special_tokens=False)


def create_app(
    config: ServerConfig,
    registry: CollectorRegistry | None = None,
    loader: Callable[[ServerConfig], ServedModel] = _load,
) -> FastAPI:
    """Build the app. `registry` receives the server's metrics; /metrics serves all of it."""
    state = State(config, registry if registry is not None else CollectorRegistry())

    async def load() -> None:
        try:
            replicas = replica_devices(
                config
            )  # one engine per device (kvtier.server.batch.replicas)
            on_first = dataclasses.replace(config, device=str(replicas[0])) if replicas else config
            served = await asyncio.to_thread(loader, on_first)
            # layers across devices (--devices), with device failover
            served = await asyncio.to_thread(place_configured, served, config, state.metrics)
            await asyncio.to_thread(_warm_up, served)
        except Exception as exc:  # a server that cannot serve exits non-zero with the
            # reason on one line (run.run_app), so that its supervisor restarts or reports it;
            # /readyz gives the reason meanwhile
            state.load_error = exc
            if not isinstance(exc, (ConfigError, BudgetError)):  # a setting's says what to do
                log.debug("the model failed to load", exc_info=True)
            state.fatal(DeviceFault.of(exc) if is_fatal_device_error(exc) else exc)
            return
        if config.max_model_len:
            served.context_tokens = min(served.context_tokens, config.max_model_len)
        if replicas:
            engine = await _opened(
                "the replicas failed to start", build_replicas, served, config, state.metrics,
                state.fatal,
            )  # fmt: skip
            if engine is not None:
                await _serve(engine)
            return
        run_config = config.for_device(served.device.type)
        try:
            # the GPU memory plan, once the weights are resident: every part's bytes inside
            # one budget, the page pool getting what is left (None on the CPU)
            plan = await asyncio.to_thread(build_plan, served, run_config)
        except ConfigError as exc:  # a budget too small for the model: no wait fixes that
            state.load_error = exc
            state.fatal(exc)
            return
        if plan is not None:
            log.info("%s", plan.describe())
            run_config = planned_config(run_config, plan)
            state.metrics.gpu_memory_plan(plan)
        backend = await _opened("the cache failed to open", make_backend, served, run_config)
        if backend is None:
            return
        # a device fault in a request stops the server, which exits non-zero (run.run_app)
        await _serve(
            Engine(served, backend, run_config, state.metrics, plan=plan, on_fatal=state.fatal)
        )

    async def _opened(what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in a thread (the cache, or the replicas with theirs); None when it
        failed. The L3 root cannot be used (another process holds it, unsafe permissions, a
        wrong or missing master key), or a setting cannot work (an L2 larger than the host's
        memory), or anything else failed: no waiting fixes that, so the server stops and says why
        rather than stay up never ready."""
        try:
            return await asyncio.to_thread(fn, *args)
        except (StoreError, EncryptionError, BudgetError, ConfigError) as exc:
            state.load_error = exc
            state.fatal(exc)
        except Exception as exc:  # exits too: a server that cannot serve says why and stops
            log.error("%s: %s: %s", what, type(exc).__name__, exc)
            log.debug("%s", what, exc_info=True)
            state.load_error = exc
            state.fatal(exc)
        return None

    async def _serve(engine: Engine) -> None:
        """Warm the engine up, then serve with it."""
        try:
            # a measured prefill rate before the first request (not the cost model's guess)
            await asyncio.to_thread(engine.warm_up)
        except Exception as exc:  # serve anyway: the first requests pay what it would have
            if engine.device_fault(exc):  # ...unless the device is lost (the server stops)
                state.load_error = engine.fatal
                return
            log.warning("warm-up through the cache failed (%s: %s); serving without it",
                        type(exc).__name__, exc)  # fmt: skip
        state.engine, state.warming = engine, True
        try:  # the HTTP route, the scheduler's first turn, the streamed response
            seconds = await warm_request(app, config.served_model_name)
            log.info("warm-up request served in %.1f ms", seconds * 1000)
        except Exception as exc:  # serve anyway: the first request pays what it would have
            log.warning("the warm-up request failed (%s: %s); serving without it",
                        type(exc).__name__, exc)  # fmt: skip
        finally:
            state.warming = False
        # Everything alive now (the model's modules and parameters, the cache, the server)
        # lives as long as the process: out of the collector's reach, a full collection no
        # longer walks it. One walked it in 160-190 ms on a 2-core host, inside requests (it
        # holds every thread), and made the first request after a restart 2-3x a recompute.
        gc.collect()
        gc.freeze()
        if engine.plan is not None:
            engine.plan = engine.plan.with_measured(**backend_device_bytes(engine.backend))
            state.metrics.gpu_memory_plan(engine.plan)
            log.info("%s; start-up peaks: %s", engine.plan.describe(), startup_peaks(engine))
        state.engine = engine
        log.info("ready: model %s, cache %s", engine.served.name, config.cache)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        log.info("%s", state.auth.describe())
        state.auth.install_sighup()
        state.metrics.watch_gc()
        task = asyncio.create_task(load())
        yield
        state.metrics.watch_gc(False)
        state.auth.remove_sighup()
        await task
        if state.engine is not None:
            await state.engine.drain()  # in-flight requests are done; hibernate every session
            log.info("drained: every session hibernated")

    app = FastAPI(
        title="kvtier",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        dependencies=[Depends(authenticate)],  # every route but /healthz, /readyz, /metrics
    )
    app.state.kvtier = state
    app.add_middleware(RequestMetrics, metrics=state.metrics)  # /v1 responses by route, code
    _install_errors(app, state)
    _routes(app, state)
    return app


def _install_errors(app: FastAPI, port: RoutePort) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if request.url.path.startswith("/v1/c"):
            port.metrics.count("errors")
        if exc.status == 400:
            _bad_request(port, request, exc)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = ApiError(400, f"invalid request: {exc.errors()[:1]}")
        _bad_request(port, request, error)
        return error.response()

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}", "server_error").response()


def _bad_request(port: RoutePort, request: Request, exc: ApiError) -> None:
    """A 400's reason, logged at debug level and counted by its code: the codes are the
    server's own (a bounded label), the message may quote the request (the log only)."""
    reason = exc.code or "invalid_request"
    log.debug("400 %s on %s %s: %s", reason, request.method, request.url.path, exc.message)
    port.metrics.bad_request(reason)


def _routes(app: FastAPI, port: RoutePort) -> None:
    """The health, metrics, model and completion routes, on the server's `RoutePort`."""
    cfg = port.config
    limits = (cfg.max_body_bytes, cfg.body_timeout, cfg.body_deadline, cfg.body_min_rate)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "uptime_seconds": round(time.time() - port.started, 3)}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        status, body = port.readiness()
        engine = port.loaded_engine()
        if status == 200 and engine is not None:
            degraded = device_readiness(engine.served.devices, cfg.served_model_name)
            if degraded is not None:  # serving on fewer devices, or the primary one is lost
                return degraded
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        data = await asyncio.to_thread(port.metrics_text)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    def card() -> dict[str, Any]:
        engine = port.loaded_engine()
        return {
            "id": cfg.served_model_name,
            "object": "model",
            "created": int(port.started),
            "owned_by": "kvtier",
            "max_model_len": engine.served.context_tokens if engine else None,
            # the token ids a prompt may hold (`/v1/completions` takes ids: `kvtier replay`)
            "vocab_size": engine.served.vocab_size if engine else None,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != cfg.served_model_name:
            raise ApiError(
                404,
                f"The model `{model_id}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return card()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body: ChatRequest = await read_body(request, ChatRequest, *limits)
        engine = _check_model(body.model)
        messages = [m.rendered() for m in body.messages]
        # rendered and tokenized off the loop, length-bounded first
        ids = await chat_ids(engine.served, messages, body.tool_list())
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await respond(port, request, engine, body, ids, max_tokens, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await read_body(request, CompletionRequest, *limits)
        engine = _check_model(body.model)
        ids = await completion_ids(engine.served, body.prompt)
        return await respond(port, request, engine, body, ids, body.max_tokens, chat=False)

    def _check_model(name: str) -> Engine:
        if name != cfg.served_model_name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return port.ready_engine()

    install_admin_routes(app, port)
    install_device_routes(app, port)
