"""Server settings from flags, `KVTIER_*` environment variables and a TOML file, in that order.

Every setting has one name; the flag is `--name-with-dashes`, the variable `KVTIER_NAME` and the
TOML key `name` in the `[serve]` table. docs/configuration.md lists them all.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvtier import units
from kvtier.errors import ConfigError
from kvtier.types import CODECS, WRITE_POLICIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "KVTIER_"
# Sizes: one parser and one meaning for every entry point (kvtier.units, docs/configuration.md).
parse_size = units.parse_size


def default_l3_root() -> Path:
    """A private directory under the user's data dir (never /tmp, which is cleared at boot)."""
    import platformdirs

    return Path(platformdirs.user_data_dir("kvtier", appauthor=False)) / "l3"


# `prompt_order`: oldest first, or the fewest prompt tokens left first (docs/configuration.md)
PROMPT_ORDERS = ("arrival", "shortest")
# The batch's slots by device type when `max_concurrency` is 0: on a GPU the fleet bench's 64
# sessions decode in one step (the page pool bounds the batch besides); on 2 CPU cores, 8.
DEFAULT_MAX_CONCURRENCY = {"cuda": 64, "cpu": 8}
# The cache's L1 with its copy staging where no GPU memory plan sizes it
DEFAULT_L1_BYTES = 256 * 2**20
# `cache`: the tiers (the default), the page pool alone (GPU-only prefix caching), nothing
CACHES = ("tiered", "pool", "none")
# `load_format`: vLLM's names (docs/configuration.md)
LOAD_FORMATS = ("auto", "dummy")
# The interpreter's GIL switch interval while a scheduler runs (Python's default: 5 ms). Every
# torch call of the scheduler thread releases the GIL and takes it back, and the restore,
# commit and event-loop threads run Python meanwhile: at 5 ms one step's dozen calls could wait
# longer than the step (docs/architecture.md, "The GIL").
SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class ServerConfig:
    """Everything `kvtier serve` can be told. Sizes are bytes; times are seconds."""

    host: str = "127.0.0.1"
    port: int = 8000
    l3_root: Path = field(default_factory=default_l3_root)
    l3_cold_root: Path | None = None  # cold chunks (kvtier l3 migrate); None: as recorded
    model: Path | None = None  # a local Hugging Face directory; None = the built-in random model
    model_id: str | None = None  # identity in the cache fingerprint; None = the directory name
    # "auto": the weights in the model directory; "dummy": random weights built from its
    # config.json alone, directly in their dtype on the device (a model at full scale with no
    # download; the built-in byte tokenizer when the directory holds none)
    load_format: str = "auto"
    served_model_name: str = "default"
    # a session's longest context in tokens (prompt and reply); 0: the model's
    # max_position_embeddings. The GPU memory plan needs one such session to fit the page pool
    max_model_len: int = 0
    device: str | None = None  # "cpu", "cuda", "cuda:1"; None = cuda when available
    # The one GPU memory budget of the process, as a fraction of the device's memory: the
    # weights, the activations' peak, the CUDA graphs, the copy staging, the cache's L1, copies
    # in flight and the page pool all live inside it (kvtier.server.devices.memplan; `kvtier plan`)
    gpu_memory_utilization: float = 0.9
    # decoder layers across devices: "auto" (every visible GPU), "0,1"; "" = all on `device`
    devices: str = ""
    # data-parallel replicas: one engine (its own model copy, page pool and batch) per device,
    # sharing the host tiers (L2/L3, L4): "auto" (every visible GPU), "0,1", "cpu,cpu"; "" = one
    # engine (kvtier.server.batch.replicas; docs/architecture.md, "Replicas")
    replicas: str = ""
    # degraded mode (a device lost): turns longer than sinks + window run over the first
    # `degraded_sinks` and the last `degraded_window` tokens (StreamingLLM); 0 = off (fewer
    # sessions run at once instead)
    degraded_window: int = 0
    degraded_sinks: int = 4
    # degraded mode's page pool on the survivors: "native" (the model's dtype) or "int8" (K/V
    # as int8 with a scale per token and head: about twice the tokens in the same bytes)
    degraded_kv: str = "native"
    seed: int = 0  # seed of the built-in model's random weights
    # "tiered" (L1/L2/L3), "pool" (the batch's page pool alone, as vLLM's automatic prefix
    # caching: nothing stored; a baseline) or "none" (recompute every prefix; a baseline)
    cache: str = "tiered"
    # the cache's GPU buffers (L1) with the copy staging; 0: the GPU memory plan sizes it
    # (DEFAULT_L1_BYTES on the CPU and for a model placed across devices)
    l1_bytes: int = 0
    l2_bytes: int = 1 * 2**30
    # L3's size cap (unreferenced chunks go first); 0 = half the filesystem that holds L3
    l3_max_bytes: int = 0
    # L4, the shared tier: redis://host:port/db; None (or "") = none. Hosts sharing one Redis
    # resume each other's sessions (docs/architecture.md, "L4")
    l4_url: str | None = None
    l4_ttl_s: float = 86400.0  # L4 chunks and session records expire this long after a write
    l4_min_idle_s: float = 0.0  # write a hibernated session to L4 once idle this long
    # Sessions in memory (docs/configuration.md): an idle session inactive this long, or past
    # max_sessions the least recently active, is hibernated and leaves memory; its next turn
    # finds it in L3 (a record read) and restores from L2/L3. 0: no such bound
    session_ttl_s: float = 3600.0
    max_sessions: int = 10_000
    # write_through: a committed chunk whose L3 write was shed (queue full) is queued again,
    # so that none stays out of L3 much longer than this (docs/architecture.md, "L3")
    l3_write_bound_s: float = 5.0
    chunk_tokens: int = 256
    codec: str = "native"
    write_policy: str = "write_through"
    l3_writer: str = "auto"  # "process" (L3 file writes in a child) with CUDA, else "threads"
    isolate_cpus: bool = True  # generation threads on a core of their own, disk work elsewhere
    cudnn_attention: bool = False  # PyTorch's cuDNN SDPA; off: it plans every new length anew
    # sessions generating at once (with batching: the most in one forward). L1 must hold this
    # many sessions' KV at once: raise l1_bytes with it
    # (0: DEFAULT_MAX_CONCURRENCY of the device: 64 on a GPU, 8 on the CPU)
    max_concurrency: int = 0
    max_queue: int = 256  # requests waiting for a slot; beyond it: 429 at once
    queue_timeout: float = 30.0  # longest wait for a slot before 429 + Retry-After
    max_tokens_limit: int = 4096  # largest max_tokens a request may ask for
    # how tool calls are read out of a reply to a request with `tools` (kvtier.server.decoding.tools):
    # "hermes" (<tool_call> blocks; Qwen2.5, Hermes), or "none" (the reply stays text)
    tool_call_parser: str = "hermes"
    prefill_step: int = 512  # prompt tokens per forward, so other sessions interleave
    batching: bool = True  # one forward per step for every running session (off: one thread each)
    cuda_graphs: bool = True  # with batching on CUDA: decode steps replayed as CUDA graphs
    # with cuda_graphs: a second graph per decode bucket for steps without prompt rows, on the
    # one-row attention kernel (kvtier.paged.graphs); on since the fleet measured +22 % tok/s
    # at 64 sessions with it once the attention was fused (docs/benchmarks.md)
    decode_graphs: bool = True
    # with batching on CUDA: every RMSNorm and gated-SiLU MLP of the model runs as one Triton
    # kernel each (kvtier.paged.fused); on since the H200 fleet measured +18 % tok/s with it
    fused_kernels: bool = True
    # with fused_kernels: each Llama-style attention's rotary embedding and page write as one
    # Triton kernel and its q/k/v projections as one GEMM (kvtier.paged.fused_rope); on since
    # an H100 measured the batch-64 decode step 12.56 -> 11.17 ms with it (docs/benchmarks.md)
    fused_attention: bool = True
    # with batching: an all-greedy step starts before the last one's tokens reach the host
    overlap_steps: bool = True
    batch_tokens: int = 1024  # new tokens in one batched forward: decode tokens + prompt chunks
    # prompt tokens in a step that also decodes: short, even steps for the decoding sessions
    # (0: up to batch_tokens, as a step without decoders). 192 on the H200 fleet bench: 7 %
    # more tok/s than 128 with 64 sessions, 4 % more with 256 (docs/benchmarks-history.md)
    decoding_prompt_tokens: int = 192
    # with batching: the order in which prompts that one decoding step's budget takes whole
    # get it: "arrival" (oldest first: the slowest first tokens are shortest when no turn
    # waits for a slot) or "shortest" (fewest tokens left first: a lower mean when turns queue
    # for slots). Longer prompts go after them either way (docs/configuration.md)
    prompt_order: str = "arrival"  # one of PROMPT_ORDERS
    # turns admitted into the batch in one step (0: as many as the budget, slots and pages
    # allow); each one is host work (pages, the copy of its restored prefix) before a launch
    admissions_per_step: int = 0
    # with batching: restore threads, and as many commit threads (0: 8 on a GPU, 2 on the CPU,
    # where they compete with the scheduler for the cores; kvtier.server.batch.restoring)
    helper_threads: int = 0
    # with batching: the interpreter's GIL switch interval while the scheduler runs (Python's
    # own is 5 ms; kvtier.server.batch.schedthread)
    switch_interval_s: float = SWITCH_INTERVAL_S
    # with batching: a finished turn's KV pages stay in the pool for its session's next turn
    # (restored from L1, it starts from them, no copy of its prefix) while nothing else needs
    # them. On whenever paged_l1 is; this turns it on alone, beside L1 buffers
    # (docs/architecture.md, "Parked pages")
    park_pages: bool = False
    # with batching: the page pool is the sessions' L1 (implies park_pages). A finished turn's
    # new chunks go from its pages to L2, the cache keeps no L1 copy of the session, and a
    # returning turn starts from its parked pages or restores from L2/L3 (docs/architecture.md,
    # "Paged L1"). Native codec, one device (else off). On an H200 the 256-session fleet served
    # 3,480-3,765 tok/s with it against 2,685-3,371 without (docs/benchmarks-history.md, "Paged L1")
    paged_l1: bool = True
    batch_kv_bytes: int = 0  # the batch's KV page pool; 0 = room for max_concurrency contexts
    max_body_bytes: int = 4 * 2**20
    # Structured output (kvtier.server.decoding.grammarlimits; docs/security.md, "Limits"): a schema's
    # JSON text, a pattern's bounded repetitions, enum and const values; the wait for a
    # grammar, the threads that compile, the compiled grammars kept (LRU)
    grammar_max_schema_bytes: int = 64 * 2**10
    grammar_max_repeat: int = 1000
    grammar_max_enum: int = 1024
    grammar_timeout: float = 10.0
    grammar_threads: int = 2
    grammar_cache_bytes: int = 128 * 2**20
    # Connections (kvtier.server.http.connguard; docs/serving.md, "Behind a proxy"): seconds a
    # connection has to send a request's line and headers, else it is closed
    header_timeout: float = 10.0
    body_timeout: float = 30.0  # longest wait for the next piece of a request body: then 408
    # a whole request body: within this many seconds, and at least this many bytes a second
    # after the first 5 s (kvtier.server.http.requestbody); else 408 and the connection closes
    body_deadline: float = 60.0
    body_min_rate: int = 1024
    # an idle keep-alive connection's life: longer than clients keep idle connections (httpx:
    # 5 s), so the client closes first (equal timeouts race a request against the close)
    keep_alive_timeout: float = 75.0
    max_connections: int = 0  # open connections; 0: the open-files limit less a reserve
    # connections past max_connections kept for /healthz, /readyz and /metrics (any other
    # request on one of them gets 503): probes never see the cap
    probe_connections: int = 16
    max_open_files: int = 0  # the soft open-files limit set at start; 0: the hard limit
    log_level: str = "info"
    # Authentication (kvtier.server.http.auth): the API keys file; None = single-tenant and local
    api_keys: Path | None = None
    trust_tenant_header: bool = False  # with api_keys: X-Tenant names the tenant (a gateway's)
    # serve on a non-loopback address without api_keys (else refused: anyone who reaches it
    # would chat as any tenant)
    insecure_no_auth: bool = False
    # Encryption at rest of L3 (docs/security.md): chunk payloads and session records sealed
    # with per-tenant data keys wrapped by the master key in this file (32 bytes, mode 0600).
    encrypt: bool = False
    master_key_file: Path | None = None

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port: {self.port} is not a TCP port; use 1..65535")
        if self.l3_writer not in ("auto", "process", "threads"):
            raise ConfigError(
                f"l3_writer: {self.l3_writer!r} is unknown; use auto, process or threads"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization: {self.gpu_memory_utilization} is not a fraction of the "
                "GPU's memory; use a value in (0, 1], for example 0.9"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format: {self.load_format!r} is unknown; use 'auto' (the weights in "
                "--model) or 'dummy' (random weights from its config.json alone)"
            )
        if self.cache not in CACHES:
            raise ConfigError(f"cache: {self.cache!r} is unknown; use 'tiered', 'pool' or 'none'")
        if self.cache == "pool" and not (
            self.batching and self.paged_l1 and self.codec == "native" and not self.devices
        ):
            raise ConfigError(
                "cache: 'pool' keeps K/V in the batch's page pool, so it needs batching and "
                "paged_l1 on, the native codec and one device (no --devices); drop the flag "
                "that turns one off, or use --cache none for a baseline without any cache"
            )
        if self.max_concurrency < 0 or self.l1_bytes < 0 or self.max_model_len < 0:
            raise ConfigError(
                "max_concurrency, l1_bytes and max_model_len must not be negative (0: automatic)"
            )
        for name in (
            "chunk_tokens",
            "max_tokens_limit",
            "prefill_step",
            "batch_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.decoding_prompt_tokens < 0:
            raise ConfigError(
                f"decoding_prompt_tokens: must not be negative, got {self.decoding_prompt_tokens}"
                " (0 means up to batch_tokens)"
            )
        if self.codec not in CODECS:
            raise ConfigError(f"codec: {self.codec!r} is unknown; use one of {', '.join(CODECS)}")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"write_policy: {self.write_policy!r} is unknown; use one of "
                f"{', '.join(WRITE_POLICIES)}"
            )
        if self.prompt_order not in PROMPT_ORDERS:
            raise ConfigError(
                f"prompt_order: {self.prompt_order!r} is unknown; use 'arrival' (oldest first) "
                "or 'shortest' (fewest prompt tokens left first)"
            )
        if self.tool_call_parser not in ("hermes", "none"):
            raise ConfigError(
                f"tool_call_parser: {self.tool_call_parser!r} is unknown; use 'hermes' "
                "(<tool_call> blocks, as Qwen2.5 and Hermes write them) or 'none'"
            )
        if self.admissions_per_step < 0:
            raise ConfigError(
                f"admissions_per_step: must not be negative, got {self.admissions_per_step}"
                " (0 means no limit)"
            )
        if self.helper_threads < 0:
            raise ConfigError(
                f"helper_threads: must not be negative, got {self.helper_threads} (0: automatic)"
            )
        if not self.switch_interval_s > 0:
            raise ConfigError("switch_interval_s: must be a positive number of seconds")
        if self.degraded_window < 0 or self.degraded_sinks < 0:
            raise ConfigError("degraded_window and degraded_sinks must not be negative")
        if self.degraded_kv not in ("native", "int8"):
            raise ConfigError(
                f"degraded_kv: {self.degraded_kv!r} is unknown; use 'native' (K/V in the "
                "model's dtype) or 'int8' (about twice the tokens on the surviving devices)"
            )
        for name in ("grammar_max_repeat", "grammar_max_enum", "grammar_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be at least 1, got {getattr(self, name)}")
        for name in (
            "header_timeout",
            "body_timeout",
            "keep_alive_timeout",
            "grammar_timeout",
            "body_deadline",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be a positive number of seconds")
        if self.max_connections < 0 or self.max_open_files < 0:
            raise ConfigError("max_connections and max_open_files must not be negative (0: auto)")
        if self.probe_connections < 0 or self.body_min_rate < 0:
            raise ConfigError(
                "probe_connections and body_min_rate must not be negative (0: none, no minimum)"
            )
        if self.queue_timeout < 0 or self.max_queue < 0:
            raise ConfigError("queue_timeout and max_queue must not be negative")
        if self.session_ttl_s < 0 or self.max_sessions < 0:
            raise ConfigError("session_ttl_s and max_sessions must not be negative (0: no bound)")
        if not self.l3_write_bound_s > 0:
            raise ConfigError("l3_write_bound_s: must be a positive number of seconds")
        if not self.served_model_name:
            raise ConfigError("served_model_name: must not be empty")
        if self.api_keys is None and not self.insecure_no_auth and not is_loopback(self.host):
            raise ConfigError(
                f"host {self.host}: serving beyond this machine without API keys lets any host "
                "that reaches it chat as any tenant and read its sessions; give --api-keys FILE "
                "(kvtier keys add), bind 127.0.0.1, or pass --insecure-no-auth to accept that"
            )
        if self.trust_tenant_header and self.api_keys is None:
            raise ConfigError(
                "trust_tenant_header: only with api_keys (without a keys file X-Tenant is "
                "always used); give --api-keys too, or drop --trust-tenant-header"
            )
        if self.replicas.strip() and self.devices.strip():
            raise ConfigError(
                f"replicas ({self.replicas!r}) and devices ({self.devices!r}) are two layouts: "
                "replicas copy the model to each device, devices split its layers across them; "
                "give one (replicas for a model that fits one device)"
            )
        if self.encrypt and self.master_key_file is None:
            raise ConfigError(
                "encrypt: needs master_key_file (flag --master-key-file, variable "
                "KVTIER_MASTER_KEY_FILE): a file of 32 random bytes, mode 0600"
            )

    @classmethod
    def load(
        cls,
        flags: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        file: str | Path | None = None,
    ) -> ServerConfig:
        """Merge defaults < TOML file < environment < flags (None in `flags` = not given)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        file = file or env.get(ENV_PREFIX + "CONFIG")
        if file:
            values.update(_from_toml(Path(file)))
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = raw
        for key, value in (flags or {}).items():
            if value is not None:
                if key not in _FIELDS:
                    raise ConfigError(f"unknown setting {key!r}")
                values[key] = value
        return cls(**{k: _coerce(k, v) for k, v in values.items()})

    def for_device(self, device_type: str) -> ServerConfig:
        """These settings with the automatic ones (0) resolved for a `device_type` device: the
        batch's slots, and L1 where no memory plan sizes it (the CPU)."""
        changes: dict[str, Any] = {}
        if self.max_concurrency == 0:
            changes["max_concurrency"] = DEFAULT_MAX_CONCURRENCY.get(device_type, 8)
        if self.l1_bytes == 0 and device_type != "cuda":
            changes["l1_bytes"] = DEFAULT_L1_BYTES
        return dataclasses.replace(self, **changes) if changes else self

    def as_dict(self) -> dict[str, Any]:
        return {
            k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()
        }


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine's loopback alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_FIELDS = {f.name: f for f in fields(ServerConfig)}
_SIZES = {"l1_bytes", "l2_bytes", "l3_max_bytes", "max_body_bytes", "batch_kv_bytes"}
_SIZES |= {"grammar_max_schema_bytes", "grammar_cache_bytes"}


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path} does not exist; fix --config / KVTIER_CONFIG"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    table = data.get("serve", {})
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path}: [serve] must be a table")
    unknown = sorted(set(table) - set(_FIELDS))
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown key(s) {', '.join(unknown)} in [serve]; "
            f"known keys: {', '.join(sorted(_FIELDS))}"
        )
    return dict(table)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _coerce(name: str, value: Any) -> Any:
    """Turn a flag, environment string or TOML value into the field's type, or say what's wrong."""
    if name in _SIZES:
        return parse_size(value, name)
    default = _FIELDS[name].default
    try:
        if name in ("l3_root", "l3_cold_root", "model", "api_keys", "master_key_file"):
            return Path(value).expanduser()
        if name == "device":
            return str(value)
        if name in ("devices", "replicas") and isinstance(value, (list, tuple)):  # [0, 1]
            return ",".join(str(v) for v in value)
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            word = str(value).strip().lower()
            if word not in _TRUE + _FALSE:
                raise ValueError(word)
            return word in _TRUE
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except (TypeError, ValueError):
        kind = "true/false (or yes/no, on/off, 1/0)" if isinstance(default, bool) else None
        raise ConfigError(
            f"{name}: cannot read {value!r} as {kind or type(default).__name__} "
            f"(flag --{name.replace('_', '-')}, variable {ENV_PREFIX}{name.upper()})"
        ) from None
    return str(value)
