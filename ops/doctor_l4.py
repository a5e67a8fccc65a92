"""`kvtier doctor --l4-url URL`: the shared L4 tier's Redis, checked for the settings that decide
what happens when it fills up: `maxmemory` and `maxmemory-policy`.

Like `ops.doctor`, two halves: `collect_l4(url)` asks Redis (CONFIG GET, INFO) and returns a
frozen `L4Facts`; `check_l4(facts)` is a pure function of them that returns `Finding`s.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ops.doctor import Finding, _size

# Policies that evict the least recently (LRU) or least frequently (LFU) used keys: a full Redis
# drops cold chunks and keeps taking writes. `volatile-*` only evicts keys with a TTL.
GOOD_POLICIES = ("allkeys-lru", "volatile-lru", "allkeys-lfu", "volatile-lfu")
RECOMMENDED_POLICY = "allkeys-lru (or volatile-lru)"
TIMEOUT_S = 3.0

REACHABLE_WHY = (
    "The L4 tier shares hibernated sessions between hosts. While Redis cannot be reached the "
    "server's circuit breaker keeps serving from L1-L3 or recompute, but no session is shared."
)
MAXMEMORY_WHY = (
    "Without maxmemory Redis grows with every hibernated session until the host runs out of "
    "memory: it swaps, or the OOM killer ends it (or the server beside it). With a limit and an "
    "evicting policy, Redis drops cold chunks instead, and kvtier reads an evicted chunk as a miss."
)
POLICY_WHY = (
    "With noeviction a full Redis refuses every write (OOM command not allowed): kvtier sheds "
    "the writes and sessions hibernated from then on are not shared. An LRU or LFU policy "
    "evicts the coldest chunks and keeps accepting new ones (volatile-* evicts only keys with a "
    "TTL, which kvtier's chunks carry)."
)


@dataclass(frozen=True)
class L4Facts:
    """What Redis said; None where it did not say (and `error` or `config_error` says why)."""

    url: str  # without its password
    error: str | None = None  # Redis could not be reached or asked
    config_error: str | None = None  # reachable, but CONFIG GET refused (managed Redis, ACLs)
    version: str | None = None
    maxmemory: int | None = None
    policy: str | None = None
    used_memory: int | None = None


def redact(url: str) -> str:
    """`url` without the password of its userinfo (`redis://user:***@host:6379/0`)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "(unparsable URL)"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def collect_l4(url: str, timeout: float = TIMEOUT_S) -> L4Facts:
    """Ask the Redis at `url` for its version, memory use and eviction settings."""
    shown = redact(url)
    try:
        import redis
    except ImportError:
        return L4Facts(shown, error="the redis Python package is not installed")
    try:
        client: Any = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True
        )
    except ValueError as exc:
        return L4Facts(shown, error=f"not a Redis URL: {exc}")
    try:
        return _ask(client, shown, redis.RedisError)
    except redis.RedisError as exc:
        return L4Facts(shown, error=f"{type(exc).__name__}: {exc}")
    finally:
        client.close()


def _ask(client: Any, shown: str, error: type[Exception]) -> L4Facts:
    server, memory = client.info("server"), client.info("memory")
    version, used = server.get("redis_version"), memory.get("used_memory")
    used = used if isinstance(used, int) else None
    try:
        config = client.config_get("maxmemory*")
    except error as exc:  # CONFIG disabled (rename-command) or not permitted (ACL)
        return L4Facts(shown, config_error=str(exc), version=version, used_memory=used)
    maxmemory = str(config.get("maxmemory", ""))
    return L4Facts(
        shown,
        version=version,
        maxmemory=int(maxmemory) if maxmemory.isdigit() else None,
        policy=config.get("maxmemory-policy"),
        used_memory=used,
    )


def check_l4(facts: L4Facts) -> Iterator[Finding]:
    """Reachable; maxmemory set; an evicting maxmemory-policy."""
    cli = f"redis-cli -u {facts.url}"
    if facts.error is not None:
        fix = "pip install redis (kvtier's dependency)" if "package" in facts.error else (
            f"start Redis or correct the URL (--l4-url, KVTIER_L4_URL); test with `{cli} ping`"
        )  # fmt: skip
        yield Finding(
            "l4.reachable", "warning", f"{facts.url}: {facts.error}", "Redis answers",
            REACHABLE_WHY, fix,
        )  # fmt: skip
        return
    yield Finding(
        "l4.reachable", "ok", f"{facts.url}: Redis {facts.version or '?'}", "Redis answers",
        REACHABLE_WHY, "nothing to do",
    )  # fmt: skip
    if facts.config_error is not None:
        for check_id, why in (("l4.maxmemory", MAXMEMORY_WHY), ("l4.maxmemory_policy", POLICY_WHY)):
            yield Finding(
                check_id, "info", f"cannot read it: CONFIG GET refused ({facts.config_error})",
                f"maxmemory set, maxmemory-policy {RECOMMENDED_POLICY}", why,
                "check it where this Redis is managed (its provider's console or redis.conf)",
            )  # fmt: skip
        return
    used = f" (used {_size(facts.used_memory)})" if facts.used_memory is not None else ""
    if facts.maxmemory is None:
        sev, observed = "info", "unknown"
    elif facts.maxmemory == 0:
        sev, observed = "warning", f"0: no limit{used}"
    else:
        sev, observed = "ok", f"{_size(facts.maxmemory)}{used}"
    yield Finding(
        "l4.maxmemory", sev, observed, "a limit below the memory Redis's host can give it",
        MAXMEMORY_WHY,
        f"`{cli} config set maxmemory 48gb` (your size) and `maxmemory 48gb` in redis.conf "
        "to keep it across restarts",
    )  # fmt: skip
    policy = facts.policy
    if policy in GOOD_POLICIES:
        sev = "ok"
    elif policy == "noeviction":
        sev = "warning"
    else:
        sev = "info"  # random or TTL eviction: full Redis keeps working, evicts blindly
    yield Finding(
        "l4.maxmemory_policy", sev, str(policy), RECOMMENDED_POLICY, POLICY_WHY,
        f"`{cli} config set maxmemory-policy allkeys-lru` and `maxmemory-policy allkeys-lru` "
        "in redis.conf",
    )  # fmt: skip
