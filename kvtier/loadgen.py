"""A fleet of agent sessions against an OpenAI-compatible server, with latency by restore source.

Each session is one agent: a long system prompt shared by every session, then turns of
user message -> streamed assistant reply -> tool-call pause -> tool result, so the conversation
grows every turn. TTFT and inter-token latency are split by the restore source the server
reports (`X-Kvtier-Restore-Source`), which shows what the tiered cache buys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtier.loadgen_hosts import by_host, fleet_ttft, host_of, merge_tiers
from kvtier.loadgen_metrics import server_ttft
from kvtier.loadgen_report import (
    RESTORED,
    compare_pairs,
    format_report,
    percentile,
    plot,
    report,
    summarize,
    tiers_during,
)

__all__ = [
    "RESTORED",
    "Fleet",
    "LoadConfig",
    "Sample",
    "format_report",
    "percentile",
    "plot",
    "report",
    "run",
    "summarize",
]

SOURCE_HEADER = "x-kvtier-restore-source"
# Tokens a chat template adds around each message (role markers, separators): the estimate of
# the next turn's prompt adds this per new message, so a session starts over a little early
# rather than be refused.
TEMPLATE_TOKENS = 16


@dataclass(frozen=True)
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    # Several servers: each session's turns go round them (kvtier.loadgen_hosts); `url` unused.
    urls: tuple[str, ...] = ()
    sessions: int = 100
    turns: int = 10
    think_ms: float = 2000.0  # mean tool-call pause between turns (uniform 0.5x..1.5x)
    max_tokens: int = 32
    # every reply runs to max_tokens: the end token ends none (the server's `ignore_eos`), for
    # benchmarks that need replies of a fixed length (random weights end them early at random)
    ignore_eos: bool = False
    system_chars: int = 3000  # the shared system prompt (tool schemas, instructions)
    user_chars: int = 200
    tool_chars: int = 400  # each tool result appended to the conversation
    duration: float | None = None  # stop starting turns after this many seconds
    ramp: float | None = None  # spread session starts over this many seconds (default think)
    model: str = "default"
    tenant: str = "loadgen"
    seed: int = 0
    timeout: float = 120.0
    hibernate_during_tools: bool = False  # tell the server when an agent waits on a tool
    compare: int = 8  # same-prompt restore vs recompute probes at the end (0 = skip)
    # `Authorization: Bearer` on every request, for a server with --api-keys (the key names
    # the tenant there, and `tenant` is not sent). --hibernate-during-tools needs an admin key.
    api_key: str | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def hosts(self) -> tuple[str, ...]:
        """The servers the fleet drives: `urls`, else `url` alone."""
        return tuple(self.urls) or (self.url,)


@dataclass
class Sample:
    """One request as the client saw it."""

    session: int
    turn: int
    start: float  # seconds since the run started
    source: str = "unknown"
    status: int = 0
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    host: str = ""  # the server that answered it (its base URL)
    restarted: bool = False  # the agent started its conversation over before this turn


def _text(rng: random.Random, n: int, vocab: str = "abcdefghijklmnopqrstuvwxyz     ,.") -> str:
    return "".join(rng.choice(vocab) for _ in range(n))


def auth_headers(cfg: LoadConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


class Fleet:
    def __init__(self, config: LoadConfig) -> None:
        self.config = config
        self.hosts = config.hosts()
        rng = random.Random(config.seed)
        self.system = "You are a support agent. Tools: " + _text(rng, config.system_chars)
        self.samples: list[Sample] = []
        self.conversations: dict[int, list[dict[str, str]]] = {}
        self.t0 = 0.0
        self.metrics_error: str | None = None
        self.probe_tenants: list[tuple[int, str]] = []  # (host, fresh tenant) of each probe
        # the smallest max_model_len the servers' /v1/models report (None: not reported)
        self.context_limit: int | None = None
        self.restarts: dict[int, int] = {}  # agent -> times it started its conversation over

    def session_id(self, i: int) -> str:
        """Agent i's current session: a new one each time it starts its conversation over."""
        base = f"lg-{self.config.run_id}-{i:05d}"
        n = self.restarts.get(i, 0)
        return f"{base}-r{n}" if n else base

    async def read_context_limit(self, clients: list[httpx.AsyncClient]) -> None:
        """The longest context the servers accept: `max_model_len` of their /v1/models."""
        limits = []
        for client in clients:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                resp = await client.get("/v1/models")
                if resp.status_code == 200:
                    card = resp.json()["data"][0]
                    if card.get("max_model_len"):
                        limits.append(int(card["max_model_len"]))
        self.context_limit = min(limits) if limits else None

    def outgrows(self, sample: Sample, messages: list[dict[str, str]]) -> bool:
        """Whether the conversation's next turn (a tool result, a user message and a reply)
        would pass the servers' context, as an agent framework checks before it sends: the
        tokens this turn used, plus the new messages at this turn's tokens per character."""
        cfg, limit = self.config, self.context_limit
        if limit is None or not sample.prompt_tokens:
            return False
        chars = sum(len(m["content"]) for m in messages) or 1
        per_char = sample.prompt_tokens / chars
        new = per_char * (cfg.tool_chars + cfg.user_chars) + 3 * TEMPLATE_TOKENS
        return sample.prompt_tokens + sample.completion_tokens + new + cfg.max_tokens > limit

    def tenant_header(self) -> dict[str, str]:
        """`X-Tenant`, except with an API key (the key names the tenant; the header is
        ignored there)."""
        return {} if self.config.api_key else {"X-Tenant": self.config.tenant}

    def fresh(self, msgs: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, str]]:
        """The same prompt where nothing can be cached, for the recompute baseline: under a
        fresh tenant; with an API key (one tenant), behind a nonce at the very start instead,
        which changes every chunk key (a few characters longer)."""
        nonce = uuid.uuid4().hex[:8]
        if not self.config.api_key:
            return msgs, {"X-Tenant": f"probe-{nonce}"}
        first = {**msgs[0], "content": f"[{nonce}] {msgs[0]['content']}"}
        return [first, *msgs[1:]], {}

    async def chat(
        self,
        client: httpx.AsyncClient,
        messages: list[dict[str, str]],
        sample: Sample,
        headers: dict[str, str],
        max_tokens: int,
    ) -> str:
        """Stream one chat completion; fill `sample` with what was measured; return the reply."""
        body = {
            "model": self.config.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.config.ignore_eos:  # sent only when asked: a server without it refuses the field
            body["ignore_eos"] = True
        sent = time.perf_counter()
        last = None
        parts: list[str] = []
        try:
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as resp:
                sample.status = resp.status_code
                if resp.status_code != 200:
                    sample.error = refusal(resp.status_code, await resp.aread())
                    return ""
                sample.source = resp.headers.get(SOURCE_HEADER, "unknown")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if take_event(sample, event):
                        break
                    for choice in event.get("choices", []):
                        piece = choice.get("delta", {}).get("content")
                        if piece:
                            now = time.perf_counter()
                            if last is None:
                                sample.ttft = now - sent
                            else:
                                sample.itl.append(now - last)
                            last = now
                            parts.append(piece)
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            sample.error = f"{type(exc).__name__}: {exc}"
        return "".join(parts)

    async def agent(self, clients: list[httpx.AsyncClient], i: int, deadline: float | None) -> None:
        cfg = self.config
        rng = random.Random(cfg.seed * 1_000_003 + i)
        ramp = cfg.think_ms / 1000 if cfg.ramp is None else cfg.ramp
        await asyncio.sleep(rng.uniform(0, ramp))
        messages = [{"role": "system", "content": self.system}]
        self.conversations[i] = messages
        restart = False
        for turn in range(cfg.turns):
            if deadline is not None and time.perf_counter() >= deadline:
                return
            restarted, restart = restart, False
            if restarted:  # a new session with the shared system prompt, as an agent would
                self.restarts[i] = self.restarts.get(i, 0) + 1
                messages = [{"role": "system", "content": self.system}]
                self.conversations[i] = messages
            sid = self.session_id(i)
            headers = {"X-Session-ID": sid, **self.tenant_header()}
            messages.append({"role": "user", "content": _text(rng, cfg.user_chars)})
            at = host_of(i, turn, len(clients))
            client = clients[at]
            sample = Sample(i, turn, time.perf_counter() - self.t0, host=self.hosts[at])
            sample.restarted = restarted
            self.samples.append(sample)
            reply = await self.chat(client, messages, sample, headers, cfg.max_tokens)
            if sample.error is not None:
                messages.pop()  # the turn did not happen; the next one retries from here
                if CONTEXT_EXCEEDED in sample.error:
                    if len(messages) == 1:  # the system prompt alone is too long: stop
                        return
                    restart = True
            else:
                messages.append({"role": "assistant", "content": reply})
                restart = self.outgrows(sample, messages)
            if turn == cfg.turns - 1:
                return
            # The agent runs a tool: the session is idle on the server for think_ms.
            if cfg.hibernate_during_tools:
                try:
                    await client.post(f"/v1/sessions/{sid}/hibernate")
                except httpx.HTTPError:
                    pass
            await asyncio.sleep(rng.uniform(0.5, 1.5) * cfg.think_ms / 1000)
            if sample.error is None and not restart:
                messages.append({"role": "tool", "content": _text(rng, cfg.tool_chars)})

    async def probe(self, clients: list[httpx.AsyncClient]) -> dict[str, Any]:
        """Same prompts twice, one at a time: the session's own (restore) and under a fresh
        tenant with no session (nothing cached: recompute). The direct A/B of the cache, like
        for like: see `compare_pairs`. With several hosts the probe is the session's next turn
        and goes where that turn would (both requests to the same host)."""
        cfg = self.config
        convs = sorted(self.conversations.items(), key=lambda kv: -len(kv[1]))[: cfg.compare]
        pairs: list[dict[str, Any]] = []
        for i, messages in convs:
            if len(messages) < 2 or messages[-1]["role"] == "user":
                continue
            msgs = [*messages, {"role": "user", "content": "status?"}]
            done = sum(1 for m in messages if m["role"] == "assistant")
            client = clients[host_of(i, done, len(clients))]
            a = Sample(i, -1, time.perf_counter() - self.t0)
            own = {"X-Session-ID": self.session_id(i), **self.tenant_header()}
            await self.chat(client, msgs, a, own, 2)
            b = Sample(i, -1, time.perf_counter() - self.t0)
            fresh_msgs, fresh_headers = self.fresh(msgs)
            if "X-Tenant" in fresh_headers:
                self.probe_tenants.append((clients.index(client), fresh_headers["X-Tenant"]))
            await self.chat(client, fresh_msgs, b, fresh_headers, 2)
            if a.ttft is None or b.ttft is None or a.error or b.error:
                continue
            if b.source != "recompute":  # the fresh tenant found something cached: no baseline
                continue
            pairs.append(
                {
                    "session": i,
                    "source": a.source,
                    "restore_s": a.ttft,
                    "recompute_s": b.ttft,
                    "prompt_tokens": a.prompt_tokens,
                }
            )
        return compare_pairs(pairs)

    async def drop_probe_tenants(self, clients: list[httpx.AsyncClient]) -> dict[str, Any] | None:
        """Delete each probe's fresh tenant where its request went (`DELETE /v1/tenants/{t}`,
        an admin call: on loopback without API keys), so the probes leave no chunks behind."""
        if not self.probe_tenants:
            return None
        deleted, chunks, errors = 0, 0, []
        for host, tenant in self.probe_tenants:
            for attempt in range(5):
                try:
                    resp = await clients[host].delete(f"/v1/tenants/{tenant}")
                except httpx.HTTPError as exc:
                    errors.append(f"DELETE /v1/tenants failed: {type(exc).__name__}: {exc}")
                    break
                if resp.status_code == 409 and attempt < 4:  # its last request still ends
                    await asyncio.sleep(1.0)
                    continue
                if resp.status_code == 404:  # it stored nothing: nothing to delete
                    deleted += 1
                    break
                if resp.status_code != 200:
                    errors.append(f"DELETE /v1/tenants answered {resp.status_code}")
                    break
                deleted += 1
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    chunks += int(resp.json().get("chunks", 0))
                break
        return {
            "tenants": len(self.probe_tenants),
            "deleted": deleted,
            "chunks": chunks,
            "error": errors[0] if errors else None,
        }

    async def metrics(self, client: httpx.AsyncClient) -> str | None:
        """The server's /metrics text, or None (the reason in `self.metrics_error`)."""
        text, error = await scrape_metrics(client)
        if error is not None:
            self.metrics_error = error
        return text

    async def run(self) -> dict[str, Any]:
        cfg = self.config
        hosts = cfg.hosts()
        limits = httpx.Limits(max_connections=cfg.sessions + 4, max_keepalive_connections=None)
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(
                    httpx.AsyncClient(
                        base_url=url, timeout=cfg.timeout, limits=limits, headers=auth_headers(cfg)
                    )
                )
                for url in hosts
            ]
            before = [await self.metrics(c) for c in clients]
            await self.read_context_limit(clients)
            self.t0 = time.perf_counter()
            deadline = None if cfg.duration is None else self.t0 + cfg.duration
            await asyncio.gather(*(self.agent(clients, i, deadline) for i in range(cfg.sessions)))
            wall = time.perf_counter() - self.t0
            after = [await self.metrics(c) for c in clients]
            compare = await self.probe(clients) if cfg.compare > 0 else None
            if compare is not None:
                compare["probe_tenants"] = await self.drop_probe_tenants(clients)
            final = [await self.metrics(c) for c in clients]
        server: dict[str, Any] | None = None
        tiers: dict[str, Any] | None = None
        per_host: list[dict[str, Any] | None] = [None] * len(hosts)
        try:
            if len(hosts) == 1:
                if before[0] is not None and after[0] is not None:
                    server = server_ttft(before[0], after[0])
            elif any(a is not None for a in after):
                server = fleet_ttft(list(zip(before, after, strict=True)))
            # counters (hits, restores) as this run changed them: final minus before
            per_host = [
                None if text is None else tiers_during(then, text)
                for then, text in zip(before, final, strict=True)
            ]
            found = [t for t in per_host if t is not None]
            if found:
                tiers = found[0] if len(hosts) == 1 else merge_tiers(found)
        except ValueError as exc:  # not Prometheus text
            self.metrics_error = f"/metrics is not Prometheus text: {exc}"
        result = report(cfg, self.samples, wall, compare, server, tiers, self.metrics_error)
        result["context"] = {
            "max_model_len": self.context_limit,
            "restarts": sum(self.restarts.values()),
            "sessions_restarted": len(self.restarts),
        }
        if len(hosts) > 1:
            result["hosts"] = by_host(self.samples, hosts, per_host)
        return result


CONTEXT_EXCEEDED = "context_length_exceeded"


async def scrape_metrics(client: httpx.AsyncClient) -> tuple[str | None, str | None]:
    """(the server's /metrics text, None), or (None, why not)."""
    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError as exc:
        return None, f"GET /metrics failed: {type(exc).__name__}: {exc}"
    if resp.status_code != 200:
        return None, f"GET /metrics answered {resp.status_code}"
    return resp.text, None


def take_event(sample: Any, event: dict[str, Any]) -> bool:
    """A streamed event's error or usage into `sample` (a loadgen or replay sample); True when
    the event is an error, which ends the stream."""
    if "error" in event:
        sample.error = f"stream error: {event['error'].get('message')}"
        return True
    if event.get("usage"):
        u = event["usage"]
        sample.prompt_tokens = u["prompt_tokens"]
        sample.completion_tokens = u["completion_tokens"]
        details = u.get("prompt_tokens_details") or {}
        sample.cached_tokens = details.get("cached_tokens", 0)
    return False


def refusal(status: int, raw: bytes) -> str:
    """A refused request's error: `http STATUS CODE: message`, where CODE is the OpenAI error
    body's `code` (e.g. context_length_exceeded), so the report counts refusals by name."""
    text = raw[:400].decode(errors="replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        err = json.loads(raw)["error"]
        code = err.get("code") or err.get("type")
        if code:
            return f"http {status} {code}: {str(err.get('message', ''))[:200]}"
    return f"http {status}: {text[:200]}"


def run(config: LoadConfig) -> dict[str, Any]:
    return asyncio.run(Fleet(config).run())
