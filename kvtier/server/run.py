"""Run the server under uvicorn, and the click options that `kvtier serve` shares.

The `kvtier serve` command itself lives in ops (it adds host metrics to /metrics);
`python -m kvtier.server` runs the same server with the cache's metrics only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import click

from kvtier.server.config import CACHES, PROMPT_ORDERS, ServerConfig
from kvtier.types import CODECS, WRITE_POLICIES
from kvtier.units import size_option


def options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Every setting as a flag; None means 'not given' so the environment and TOML can fill it."""
    opts = [
        click.option(
            "--config",
            "config_file",
            type=click.Path(dir_okay=False, path_type=Path),
            help="TOML file with a [serve] table (also KVTIER_CONFIG; default: none).",
        ),
        click.option("--host", help="Address to bind (default 127.0.0.1)."),
        click.option("--port", type=int, help="TCP port (default 8000)."),
        click.option(
            "--l3-root",
            type=click.Path(file_okay=False, path_type=Path),
            help="Directory of the SSD tier (default: a private dir under the user's data dir).",
        ),
        click.option(
            "--l3-cold-root",
            type=click.Path(file_okay=False, path_type=Path),
            help="Where `kvtier l3 migrate` puts cold chunks (default: as recorded in the "
            "store, else <l3-root>/cold).",
        ),
        click.option(
            "--model",
            type=click.Path(file_okay=False, path_type=Path),
            help="Local Hugging Face model directory (default: built-in random Llama).",
        ),
        click.option("--served-model-name", help="Model name clients send (default 'default')."),
        click.option("--device", help="cpu, cuda or cuda:N (default: cuda when available)."),
        click.option(
            "--devices",
            help="Decoder layers across devices of this host: auto (every visible GPU) or GPU "
            "ordinals like 0,1 (default: all on --device).",
        ),
        click.option(
            "--replicas",
            help="One engine per device, each with its own copy of the model, page pool and "
            "batch, sharing L2/L3 (and L4): auto (every visible GPU), GPU ordinals like 0,1 or "
            "cpu,cpu; a session stays on its replica and moves when that one is lost or full "
            "(default: one engine; not with --devices).",
        ),
        click.option(
            "--degraded-window",
            type=int,
            help="With a device lost, run turns longer than sinks + window over the first "
            "--degraded-sinks and the last N tokens (attention sinks + sliding window); "
            "default 0: off, fewer sessions run at once.",
        ),
        click.option(
            "--degraded-sinks", type=int, help="Attention sinks of --degraded-window (default 4)."
        ),
        click.option(
            "--degraded-kv",
            type=click.Choice(["native", "int8"]),
            help="With a device lost, the page pool on the survivors stores K/V as int8 with a "
            "scale per token and head: about twice the tokens (default native).",
        ),
        click.option(
            "--seed",
            type=int,
            help="Seed of the random weights: the built-in model's and --load-format dummy's "
            "(default 0).",
        ),
        click.option(
            "--cache",
            type=click.Choice(list(CACHES)),
            help="tiered (default): L1/L2/L3 (and L4). pool: GPU-only prefix caching, as vLLM's "
            "automatic prefix caching: K/V stays in the batch's page pool alone (a finished "
            "turn's pages park there for its session's next turn) and nothing is stored in "
            "L2 or L3; a session whose pages were taken for others recomputes (a baseline; "
            "needs batching and paged L1). none: every prompt recomputed (a baseline).",
        ),
        click.option(
            "--gpu-memory-utilization",
            type=float,
            help="The process's one GPU memory budget, as a fraction of the device's memory "
            "(default 0.9): weights, activations, CUDA graphs, copy staging, L1, copies in "
            "flight and the page pool all live inside it; the pool gets what is left "
            "(`kvtier plan` prints the plan).",
        ),
        click.option(
            "--max-model-len",
            type=int,
            help="A session's longest context in tokens (default: the model's "
            "max_position_embeddings); one such session must fit the GPU memory plan's pool.",
        ),
        click.option(
            "--load-format",
            type=click.Choice(["auto", "dummy"]),
            help="auto (default): the weights in --model; dummy: random weights from its "
            "config.json alone, built in their dtype on the device (no download).",
        ),
        click.option(
            "--l1-bytes",
            callback=size_option,
            help="The cache's GPU buffers (L1) and copy staging, e.g. 8GiB (default: what the "
            "memory plan gives; an override is checked against the budget).",
        ),
        click.option(
            "--l2-bytes",
            callback=size_option,
            help="Pinned host RAM (L2), allocated once at start, e.g. 32GiB (default 1GiB).",
        ),
        click.option(
            "--l3-max-bytes",
            callback=size_option,
            help="L3 size cap, e.g. 500GB; past it, chunks no session references go first "
            "(default 0: half the filesystem that holds --l3-root).",
        ),
        click.option(
            "--l4-url",
            help="Shared tier (L4) on Redis, e.g. redis://10.0.0.5:6379/0, or on a Redis "
            "Cluster: redis+cluster://10.0.0.5:6379,10.0.0.6:6379; hosts sharing it resume each "
            "other's sessions (default: none).",
        ),
        click.option(
            "--session-ttl-s",
            type=float,
            help="Seconds an idle session stays in memory; then it is hibernated to L3 and "
            "its next turn finds it there (default 3600; 0: no time bound).",
        ),
        click.option(
            "--max-sessions",
            type=int,
            help="Sessions kept in memory; past it the least recently active idle ones are "
            "hibernated to L3 and leave memory (default 10000; 0: no bound).",
        ),
        click.option(
            "--l3-write-bound-s",
            type=float,
            help="With write_through, seconds within which a committed chunk whose L3 write "
            "was shed (queue full) is written after all (default 5).",
        ),
        click.option("--chunk-tokens", type=int, help="Tokens per chunk (default 256)."),
        click.option(
            "--codec",
            type=click.Choice(CODECS),
            help="How L2 and L3 store K/V: native (bit-exact, the default), int8 or fp8 "
            "(about half the bytes; docs/codecs.md).",
        ),
        click.option(
            "--write-policy",
            type=click.Choice(WRITE_POLICIES),
            help="When a committed chunk goes to L3: write_through (at once, the default), "
            "write_through_selective (only chunks seen again) or write_back (only when L2 evicts "
            "it).",
        ),
        click.option(
            "--l3-writer",
            type=click.Choice(["auto", "process", "threads"]),
            help="Where L3 file writes run: a child process or threads of the server; auto "
            "(default) picks the process with a CUDA model, threads on the CPU.",
        ),
        click.option(
            "--isolate-cpus/--no-isolate-cpus",
            default=None,
            help="With a CUDA model, generation threads on a core of their own and disk work "
            "on the others (default on; a no-op below 4 CPUs or on the CPU).",
        ),
        click.option(
            "--cudnn-attention/--no-cudnn-attention",
            default=None,
            help="Let PyTorch's attention use cuDNN (default off: it builds a plan for every new "
            "sequence length, and a served session meets one at almost every call).",
        ),
        click.option(
            "--max-concurrency",
            type=int,
            help="Sessions generating at once: the batch's slots (default 0: 64 on a GPU, 8 on "
            "the CPU). With paged L1 the pool's pages bound the batch too, so this may exceed "
            "the full contexts --batch-kv-bytes holds (see docs/configuration.md).",
        ),
        click.option(
            "--max-queue",
            type=int,
            help="Requests that may wait for a slot; any more get 429 at once (default 256).",
        ),
        click.option(
            "--queue-timeout",
            type=float,
            help="Seconds a request waits for a slot before 429 with Retry-After (default 30).",
        ),
        click.option(
            "--max-tokens-limit",
            type=int,
            help="The largest max_tokens a request may ask for (default 4096).",
        ),
        click.option(
            "--tool-call-parser",
            type=click.Choice(["hermes", "none"]),
            help="How tool calls are read out of a reply to a request with `tools`: hermes "
            "(default: <tool_call> blocks, as Qwen2.5 and Hermes models write them; the tools "
            "are offered in that format where the chat template has none), or none.",
        ),
        click.option(
            "--prefill-step",
            type=int,
            help="Prompt tokens per forward, so other sessions' decode steps interleave "
            "(default 512).",
        ),
        click.option(
            "--batching/--no-batching",
            default=None,
            help="Run every generating session in one batched forward per step (default on; "
            "off: one thread per request, taking turns on the model).",
        ),
        click.option(
            "--cuda-graphs/--no-cuda-graphs",
            default=None,
            help="With batching on a CUDA model, record the decode step as CUDA graphs at start "
            "(one per batch-size bucket) and replay them (default on).",
        ),
        click.option(
            "--decode-graphs/--no-decode-graphs",
            default=None,
            help="With CUDA graphs: also record, for each decode bucket, a graph of a step "
            "without prompt rows on the one-row attention kernel, replayed when no prompt "
            "chunk rides along (default on; it doubles the decode buckets' capture time).",
        ),
        click.option(
            "--fused-kernels/--no-fused-kernels",
            default=None,
            help="With batching on a CUDA model: run every RMSNorm and gated-SiLU MLP "
            "activation as one Triton kernel each, rounded as transformers rounds (default "
            "on; without Triton the model's own modules run).",
        ),
        click.option(
            "--fused-attention/--no-fused-attention",
            default=None,
            help="With fused kernels: also run each Llama-style attention's rotary embedding "
            "and page write as one Triton kernel and its q/k/v projections as one GEMM "
            "(default on).",
        ),
        click.option(
            "--overlap-steps/--no-overlap-steps",
            default=None,
            help="With batching: when every running request samples greedily, start the next "
            "step before the last one's tokens are read back (fed from the device), so the GPU "
            "does not wait on the scheduler (default on).",
        ),
        click.option(
            "--batch-tokens",
            type=int,
            help="New tokens in one batched forward: decode tokens plus prompt chunks "
            "(default 1024).",
        ),
        click.option(
            "--decoding-prompt-tokens",
            type=int,
            help="Prompt tokens in a batched step that also decodes (default 192; 0: up to "
            "--batch-tokens). Small keeps every decode step short; a step without decoders "
            "takes up to --batch-tokens.",
        ),
        click.option(
            "--prompt-order",
            type=click.Choice(PROMPT_ORDERS),
            help="With batching: which of the prompts that one decoding step's budget takes "
            "whole goes first (longer prompts always go after them). arrival (default): oldest "
            "first, the shortest TTFT tail when no turn waits for a slot; shortest: fewest "
            "tokens left first, a lower mean when turns queue for --max-concurrency slots.",
        ),
        click.option(
            "--admissions-per-step",
            type=int,
            help="Turns admitted into the batch in one step (default 0: as many as the token "
            "budget, slots and free pages allow). Each admission is host work before the "
            "step's launch; 1 spreads arrivals over steps.",
        ),
        click.option(
            "--park-pages/--no-park-pages",
            default=None,
            help="Keep a finished turn's KV pages in the batch's pool as its session's while "
            "no other turn needs the room; its next turn, restored from L1, starts from them "
            "instead of a copy (default off; on whenever --paged-l1 is, the default).",
        ),
        click.option(
            "--paged-l1/--no-paged-l1",
            default=None,
            help="The batch's page pool is the sessions' L1 (default on): a finished turn's "
            "new chunks go from its pages to L2, no L1 copy is kept, and the next turn starts "
            "from its parked pages (implies --park-pages; native codec, one device). Off: "
            "sessions live in L1 buffers between turns and are copied into pages per turn.",
        ),
        click.option(
            "--batch-kv-bytes",
            callback=size_option,
            help="The batch's KV page pool, e.g. 4GiB (default 0: on a GPU what the memory plan "
            "leaves of --gpu-memory-utilization's budget, a given size is checked against it; "
            "on the CPU room for --max-concurrency full contexts, at most 1 GiB).",
        ),
        click.option(
            "--max-body-bytes",
            callback=size_option,
            help="The largest request body; a larger one gets 413 (default 4MiB).",
        ),
        click.option(
            "--header-timeout",
            type=float,
            help="Seconds a connection has to send a request's line and headers, from when it "
            "opens or from the first byte of a follow-up request; then it is closed (default 10).",
        ),
        click.option(
            "--body-timeout",
            type=float,
            help="Longest wait in seconds for the next piece of a request body; then 408 "
            "(default 30).",
        ),
        click.option(
            "--body-deadline",
            type=float,
            help="Seconds a whole request body may take to arrive; then 408 and the connection "
            "closes (default 60).",
        ),
        click.option(
            "--body-min-rate",
            type=int,
            help="Bytes a second a request body must come at, on average after its first 5 s; "
            "slower gets 408 and the connection closes (default 1024; 0: no minimum).",
        ),
        click.option(
            "--keep-alive-timeout",
            type=float,
            help="Seconds an idle keep-alive connection stays open (default 75).",
        ),
        click.option(
            "--max-connections",
            type=int,
            help="Open connections at most; past it a new one closes the longest waiting for "
            "its headers, or the longest idle (default 0: the open-files limit less a reserve).",
        ),
        click.option(
            "--probe-connections",
            type=int,
            help="Connections past --max-connections kept for /healthz, /readyz and /metrics; "
            "any other request on one gets 503 (default 16).",
        ),
        click.option(
            "--grammar-max-schema-bytes",
            help="Largest JSON schema (response_format, tool parameters) compiled, e.g. 64KiB "
            "(default 64KiB).",
        ),
        click.option(
            "--grammar-max-repeat",
            type=int,
            help="Most repetitions a schema's pattern may ask for ({n}, nested counts "
            "multiplied) (default 1000).",
        ),
        click.option(
            "--grammar-max-enum",
            type=int,
            help="Most enum and const values in one schema, in total (default 1024).",
        ),
        click.option(
            "--grammar-timeout",
            type=float,
            help="Seconds a request waits for its grammar to compile; then 400 (default 10).",
        ),
        click.option(
            "--grammar-threads",
            type=int,
            help="Grammars compiled at once, on threads of their own (default 2).",
        ),
        click.option(
            "--grammar-cache-bytes",
            help="Compiled grammars kept, least recently used dropped first (default 128MiB).",
        ),
        click.option(
            "--insecure-no-auth/--no-insecure-no-auth",
            default=None,
            help="Serve on an address other than loopback without --api-keys: any host that "
            "reaches it may chat as any tenant (default off: such a start is refused).",
        ),
        click.option(
            "--max-open-files",
            type=int,
            help="The process's soft open-files limit, set at start (default 0: raised to the "
            "hard limit).",
        ),
        click.option(
            "--encrypt/--no-encrypt",
            default=None,
            help="Encrypt L3 at rest: chunk payloads and session records sealed with "
            "AES-256-GCM, one data key per tenant (default off; docs/security.md).",
        ),
        click.option(
            "--master-key-file",
            type=click.Path(dir_okay=False, path_type=Path),
            help="The master key for --encrypt: 32 random bytes (or 64 hex digits) in a file "
            "of mode 0600, e.g. from `head -c 32 /dev/urandom` (no default; docs/security.md).",
        ),
        click.option(
            "--log-level",
            type=click.Choice(["debug", "info", "warning", "error"]),
            help="The server's log level (default info); debug also logs each 400's reason.",
        ),
        click.option(
            "--api-keys",
            type=click.Path(dir_okay=False, path_type=Path),
            help="API keys file (kvtier keys add): every request needs a key, which names its "
            "tenant; reloaded on SIGHUP (default: none, single-tenant and local).",
        ),
        click.option(
            "--trust-tenant-header/--no-trust-tenant-header",
            default=None,
            help="With --api-keys, take the tenant from X-Tenant on requests with a gateway key "
            "(kvtier keys add NAME --gateway); other keys naming another tenant get 403 "
            "(default off: the key's tenant).",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def load_config(flags: dict[str, Any]) -> ServerConfig:
    """Merge flags, environment and TOML; refuse a --model that is not a model directory now,
    before the server starts, rather than leave a server up that can never become ready."""
    from kvtier.errors import ConfigError

    file = flags.pop("config_file", None)
    config = ServerConfig.load(flags=flags, file=file)
    if config.model is not None and not (config.model / "config.json").is_file():
        raise ConfigError(
            f"--model {config.model}: no config.json there; pass a local Hugging Face model "
            "directory (one written by save_pretrained), or leave --model out for the "
            "built-in model"
        )
    if config.api_keys is not None:  # an unusable keys file stops the start, with its reason
        from kvtier import apikeys

        apikeys.load(config.api_keys)
    if config.encrypt and config.master_key_file is not None:
        from kvtier.sealing import load_master_key

        load_master_key(config.master_key_file)  # unreadable, not 0600, malformed: say so now
    return config


def serve(config: ServerConfig, registry: Any = None) -> None:
    """Serve until SIGINT/SIGTERM; then drain (finish requests, hibernate sessions) and return."""
    from kvtier.server.http.app import create_app

    run_app(create_app(config, registry=registry), config)


def banner(config: ServerConfig) -> str:
    """The line a starting server prints once its port is bound and its L3 store is free."""
    auth = "api-keys" if config.api_keys else "none (single-tenant, admin on loopback)"
    return (
        f"kvtier serve: http://{config.host}:{config.port}  model={config.served_model_name}  "
        f"l3_root={config.l3_root}  auth={auth}"
    )


def run_app(app: Any, config: ServerConfig, announce: str | None = None) -> None:
    """Run a built app under uvicorn on the configured address (graceful drain on SIGTERM).

    The port is bound and the L3 store checked before the app starts, so a taken port or a
    store another process holds fails at once with one line; then `announce` is printed."""
    import uvicorn

    from kvtier.errors import ConfigError
    from kvtier.server.http import listen
    from kvtier.server.http.auth import OPEN_PATHS
    from kvtier.server.http.connguard import (
        ConnectionGuard,
        connection_cap,
        guarded_listener,
        guarded_protocol,
        probes_only,
        raise_open_files,
    )

    try:  # bound before the app starts loading the model and opening L3: a taken port fails now
        sockets = listen.bind(config.host, config.port)
    except listen.PortUnavailable as exc:
        click.echo(f"kvtier serve: {exc}", err=True)
        raise SystemExit(1) from None
    if config.cache == "tiered":
        from kvtier.tiers.l3.root import StoreInUse, check_free

        try:
            check_free(config.l3_root)
        except StoreInUse as exc:
            click.echo(f"kvtier serve: StoreInUse: {exc}", err=True)
            raise SystemExit(1) from None
    if announce:
        click.echo(announce, err=True)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # uvicorn re-raises the signal after its shutdown, so the process would die "by
            # SIGTERM". A completed drain is a clean exit: status 0, as supervisors expect.
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list) and sig in captured:
                captured.remove(sig)

    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:  # before the model's and the cache's files are opened
        open_files = raise_open_files(config.max_open_files)
    except ConfigError as exc:
        click.echo(f"kvtier serve: {exc}", err=True)
        raise SystemExit(2) from None
    guard = ConnectionGuard(
        config.header_timeout,
        connection_cap(config.max_connections, open_files),
        config.probe_connections,
    )
    sockets = [guarded_listener(sock, guard) for sock in sockets]  # the cap, at accept
    logging.getLogger("kvtier.server").info(
        "connections: at most %d open and %d more for /healthz, /readyz and /metrics (%d open "
        "files), headers within %.3g s, bodies within %.3g s at %d B/s at least",
        guard.max_connections,
        guard.reserve,
        open_files,
        config.header_timeout,
        config.body_deadline,
        config.body_min_rate,
    )
    server = Server(
        uvicorn.Config(
            probes_only(app, guard, OPEN_PATHS),  # the reserve serves the probes alone
            host=config.host,
            port=config.port,
            http=guarded_protocol(guard),  # h11 with the header timeout
            loop="asyncio",  # whose accept() guarded_listener caps (uvloop's bypasses it)
            ws="none",  # no WebSocket routes: an upgrade request is answered, not switched
            log_level=config.log_level,
            access_log=False,
            timeout_graceful_shutdown=60,
            # longer than clients keep idle connections (httpx: 5 s, uvicorn's default too), so
            # the client always closes first: with equal timeouts a request sent just as the
            # server closed its connection failed with a read error (1 of 400 in a load test)
            timeout_keep_alive=config.keep_alive_timeout,  # type: ignore[arg-type]
            h11_max_incomplete_event_size=64 * 1024,
        )
    )
    state = getattr(app.state, "kvtier", None) if hasattr(app, "state") else None
    if state is not None:
        state.stop = lambda: setattr(server, "should_exit", True)
    server.run(sockets=sockets)
    fatal = getattr(state, "fatal_error", None)
    if fatal is not None:  # one line, no traceback: the message says what to do
        click.echo(f"kvtier serve: {type(fatal).__name__}: {fatal}", err=True)
        raise SystemExit(1)
