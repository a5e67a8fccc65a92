"""CacheConfig: every knob of a TieredCache, validated at construction (fail fast)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.policy import POLICIES
from kvtier.types import CODECS, WRITE_POLICIES, Tier

L3_WRITERS = ("auto", "process", "threads")


@dataclass
class CacheConfig:
    """Configuration of a `TieredCache`. Sizes are bytes.

    l1_bytes None means half of the device's free memory at start (CUDA) or 1 GiB (CPU).

    inflight_bytes_max bounds the device memory copies in flight may hold besides L1 and the
    staging buffers (a released L1 block still going down, chunks gathered from pages; see
    kvtier.transfer.inflight); at the bound a commit or an eviction waits for copies to
    finish. None: as much as the staging buffers (`TransferEngine.default_inflight_bytes`).
    It comes on top of l1_bytes: `TieredCache.device_bytes()` gives every part.
    """

    l3_root: str | Path
    l1_bytes: int | None = None
    l2_bytes: int = 1 << 30
    chunk_tokens: int = 256
    codec: str = "native"
    write_policy: str = "write_through"
    selective_min_hits: int = 2  # write_through_selective: write a chunk once seen this often
    l2_policy: str = "lru"
    l3_max_bytes: int | None = None
    # Where `kvtier l3 migrate` puts cold chunks; None: the one recorded in the store, else
    # <l3_root>/cold. A store refuses to open with another cold root than it recorded.
    l3_cold_root: str | Path | None = None
    l3_read_bytes_per_s: float | None = None  # throttle L3 reads (shared disks, tests)
    keep_page_cache: bool = False
    model_id: str | None = None
    pin_memory: bool | None = None  # None: pin L2 iff CUDA is available
    l3_write_queue: int = 64
    l3_threads: int = 4
    inflight_bytes_max: int | None = None  # device bytes of copies in flight (see above)
    # "threads": L3 file writes from threads of this process; "process": from a child
    # process reading L2 from shared memory (Linux; see kvtier.tiers.l3.writer); "auto":
    # process with a CUDA model (whose decode loop is bound by this interpreter launching
    # kernels, which writer threads slow down), threads on the CPU
    l3_writer: str = "auto"
    session_ttl_s: float | None = None
    # Sessions in memory (docs/architecture.md, "Sessions in memory"): an idle session
    # inactive this long, or past max_sessions the least recently active, is hibernated and
    # leaves memory; its record in L3 brings it back at its next turn. None: no bound.
    session_idle_s: float | None = None
    max_sessions: int | None = None
    # write_through(_selective): a committed chunk whose L3 write was shed (queue full) is
    # queued again, so that none stays out of L3 much longer than this. None: never retried.
    l3_write_bound_s: float | None = 5.0
    cost_model: bool = True  # False: always load the longest cached prefix
    load_margin: float = 1.0  # load a prefix only if load_time * margin < recompute_time
    # Initial guesses for the cost model, replaced by measurements as they come in.
    initial_bandwidth: dict[str, float] = field(
        default_factory=lambda: {Tier.L1.value: 200e9, Tier.L2.value: 10e9, Tier.L3.value: 1e9}
    )
    initial_prefill_s_per_token: float = 1e-3
    # Encryption at rest (docs/security.md): seal L3 chunk payloads and session records with
    # per-tenant data keys wrapped by the master key in this file (32 bytes, mode 0600). An
    # encrypted store needs its key to start; a wrong one is refused before anything is read.
    encrypt: bool = False
    master_key_file: str | Path | None = None
    # L4, the shared tier on Redis (docs/architecture.md, "L4"); None: no shared tier.
    l4_url: str | None = None  # redis://[:password@]host:port/db
    l4_ttl_s: float | None = 86400.0  # chunks and records expire this long after their write
    l4_min_idle_s: float = 0.0  # write a hibernated session to L4 once idle this long
    l4_write_queue: int = 256  # chunks queued for L4 at most; a session past it is shed
    l4_read_streams: int = 4  # parallel pipelined connections of one restore's L4 reads
    l4_timeout_s: float = 2.0  # a Redis call slower than this fails (and counts for the breaker)
    l4_backoff_s: float = 1.0  # the breaker's first wait before a probe (doubles to 30 s)
    l4_health_s: float = 5.0  # ping period (latency, restarts, the half-open probe)

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0 or self.chunk_tokens % 16:
            raise ConfigError(
                f"chunk_tokens must be a positive multiple of 16, got {self.chunk_tokens}"
            )
        if self.codec not in CODECS:
            raise ConfigError(f"codec {self.codec!r} is not one of {CODECS}")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"write_policy {self.write_policy!r} is not one of {WRITE_POLICIES}")
        if self.l1_bytes is not None and self.l1_bytes <= 0:
            raise ConfigError(f"l1_bytes must be positive, got {self.l1_bytes}")
        if self.l2_bytes <= 0:
            raise ConfigError(f"l2_bytes must be positive, got {self.l2_bytes}")
        if self.selective_min_hits < 1:
            raise ConfigError("selective_min_hits must be >= 1")
        if self.l3_read_bytes_per_s is not None and self.l3_read_bytes_per_s <= 0:
            raise ConfigError("l3_read_bytes_per_s must be positive (or None for no limit)")
        if self.load_margin <= 0:
            raise ConfigError("load_margin must be positive")
        if self.l3_writer not in L3_WRITERS:
            raise ConfigError(f"l3_writer {self.l3_writer!r} is not one of {L3_WRITERS}")
        if self.l2_policy not in POLICIES:
            raise ConfigError(f"l2_policy {self.l2_policy!r} is not one of {sorted(POLICIES)}")
        if self.l3_max_bytes is not None and self.l3_max_bytes <= 0:
            raise ConfigError("l3_max_bytes must be positive (or None for no cap)")
        if self.l3_write_queue < 1:
            raise ConfigError(f"l3_write_queue must be >= 1, got {self.l3_write_queue}")
        if self.l3_threads < 1:
            raise ConfigError(f"l3_threads must be >= 1, got {self.l3_threads}")
        if self.inflight_bytes_max is not None and self.inflight_bytes_max <= 0:
            raise ConfigError(
                "inflight_bytes_max must be positive (or None: as much as the staging buffers)"
            )
        if self.session_ttl_s is not None and self.session_ttl_s < 0:
            raise ConfigError("session_ttl_s must be >= 0 (or None: sessions never expire)")
        for name in ("session_idle_s", "l3_write_bound_s"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (or None: no bound)")
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ConfigError(f"max_sessions must be >= 1 (or None), got {self.max_sessions}")
        if self.initial_prefill_s_per_token <= 0:
            raise ConfigError("initial_prefill_s_per_token must be positive")
        bad = {k: v for k, v in self.initial_bandwidth.items() if not v or v <= 0}
        if bad:
            raise ConfigError(f"initial_bandwidth values must be positive, got {bad}")
        self._check_l4()
        if not str(self.l3_root):
            raise ConfigError("l3_root must name a directory")
        if self.encrypt and not self.master_key_file:
            raise ConfigError(
                "encrypt needs master_key_file: a file of 32 random bytes, mode 0600 "
                "(create it with: (umask 077; head -c 32 /dev/urandom > PATH))"
            )
        self.l3_root = Path(self.l3_root)

    def _check_l4(self) -> None:
        if self.l4_url is not None and not self.l4_url.startswith(
            ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
        ):
            raise ConfigError(
                "l4_url must be a Redis URL (redis://host:port/db, rediss://, unix://), a Redis "
                "Cluster's (redis+cluster://host:port,host:port,...), or None"
            )
        if self.l4_ttl_s is not None and self.l4_ttl_s <= 0:
            raise ConfigError("l4_ttl_s must be positive (or None: L4 values never expire)")
        if self.l4_min_idle_s < 0:
            raise ConfigError("l4_min_idle_s must be >= 0")
        for name in ("l4_write_queue", "l4_read_streams"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("l4_timeout_s", "l4_backoff_s", "l4_health_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
