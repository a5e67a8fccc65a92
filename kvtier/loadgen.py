"""A fleet of agent sessions against an OpenAI-compatible server, with latency by restore source.

Each session is one agent: a long system prompt shared by every session, then turns of
user message -> streamed assistant reply -> tool-call pause -> tool result, so the conversation
grows every turn. TTFT and inter-token latency are split by the restore source the server
reports (`X-Kvtier-Restore-Source`), which shows what the tiered cache buys.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

SOURCE_HEADER = "x-kvtier-restore-source"
RESTORED = ("l1", "l2", "l3")


@dataclass(frozen=True)
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    sessions: int = 100
    turns: int = 10
    think_ms: float = 2000.0  # mean tool-call pause between turns (uniform 0.5x..1.5x)
    max_tokens: int = 32
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
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


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


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(values: list[float]) -> dict[str, Any]:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "p50": percentile(ms, 50),
        "p95": percentile(ms, 95),
        "p99": percentile(ms, 99),
        "mean": sum(ms) / len(ms) if ms else None,
    }


def _text(rng: random.Random, n: int, vocab: str = "abcdefghijklmnopqrstuvwxyz     ,.") -> str:
    return "".join(rng.choice(vocab) for _ in range(n))


class Fleet:
    def __init__(self, config: LoadConfig) -> None:
        self.config = config
        rng = random.Random(config.seed)
        self.system = "You are a support agent. Tools: " + _text(rng, config.system_chars)
        self.samples: list[Sample] = []
        self.conversations: dict[int, list[dict[str, str]]] = {}
        self.t0 = 0.0

    def session_id(self, i: int) -> str:
        return f"lg-{self.config.run_id}-{i:05d}"

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
        sent = time.perf_counter()
        last = None
        parts: list[str] = []
        try:
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as resp:
                sample.status = resp.status_code
                if resp.status_code != 200:
                    raw = await resp.aread()
                    sample.error = f"http {resp.status_code}: {raw[:200].decode(errors='replace')}"
                    return ""
                sample.source = resp.headers.get(SOURCE_HEADER, "unknown")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        sample.error = f"stream error: {event['error'].get('message')}"
                        break
                    if event.get("usage"):
                        u = event["usage"]
                        sample.prompt_tokens = u["prompt_tokens"]
                        sample.completion_tokens = u["completion_tokens"]
                        details = u.get("prompt_tokens_details") or {}
                        sample.cached_tokens = details.get("cached_tokens", 0)
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

    async def agent(self, client: httpx.AsyncClient, i: int, deadline: float | None) -> None:
        cfg = self.config
        rng = random.Random(cfg.seed * 1_000_003 + i)
        ramp = cfg.think_ms / 1000 if cfg.ramp is None else cfg.ramp
        await asyncio.sleep(rng.uniform(0, ramp))
        sid = self.session_id(i)
        headers = {"X-Session-ID": sid, "X-Tenant": cfg.tenant}
        messages = [{"role": "system", "content": self.system}]
        self.conversations[i] = messages
        for turn in range(cfg.turns):
            if deadline is not None and time.perf_counter() >= deadline:
                return
            messages.append({"role": "user", "content": _text(rng, cfg.user_chars)})
            sample = Sample(i, turn, time.perf_counter() - self.t0)
            self.samples.append(sample)
            reply = await self.chat(client, messages, sample, headers, cfg.max_tokens)
            if sample.error is not None:
                messages.pop()  # the turn did not happen; the next one retries from here
            else:
                messages.append({"role": "assistant", "content": reply})
            if turn == cfg.turns - 1:
                return
            # The agent runs a tool: the session is idle on the server for think_ms.
            if cfg.hibernate_during_tools:
                try:
                    await client.post(f"/v1/sessions/{sid}/hibernate")
                except httpx.HTTPError:
                    pass
            await asyncio.sleep(rng.uniform(0.5, 1.5) * cfg.think_ms / 1000)
            if sample.error is None:
                messages.append({"role": "tool", "content": _text(rng, cfg.tool_chars)})

    async def probe(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """Same prompts twice, one at a time: the session's own (restore) and under a fresh
        tenant with no session (nothing cached: recompute). The direct A/B of the cache."""
        cfg = self.config
        convs = sorted(self.conversations.items(), key=lambda kv: -len(kv[1]))[: cfg.compare]
        restored, recomputed, tokens = [], [], []
        sources: Counter[str] = Counter()
        for i, messages in convs:
            if len(messages) < 2 or messages[-1]["role"] == "user":
                continue
            msgs = [*messages, {"role": "user", "content": "status?"}]
            a = Sample(i, -1, time.perf_counter() - self.t0)
            await self.chat(
                client, msgs, a, {"X-Session-ID": self.session_id(i), "X-Tenant": cfg.tenant}, 2
            )
            b = Sample(i, -1, time.perf_counter() - self.t0)
            await self.chat(client, msgs, b, {"X-Tenant": f"probe-{uuid.uuid4().hex[:8]}"}, 2)
            if a.ttft is None or b.ttft is None or a.error or b.error:
                continue
            sources[a.source] += 1
            restored.append(a.ttft)
            recomputed.append(b.ttft)
            tokens.append(a.prompt_tokens)
        out: dict[str, Any] = {
            "n": len(restored),
            "restore_sources": dict(sources),
            "prompt_tokens_p50": percentile([float(t) for t in tokens], 50),
            "restore_ttft_ms": summarize(restored),
            "recompute_ttft_ms": summarize(recomputed),
        }
        r, c = out["restore_ttft_ms"]["p50"], out["recompute_ttft_ms"]["p50"]
        out["speedup_p50"] = (c / r) if r and c else None
        return out

    async def run(self) -> dict[str, Any]:
        cfg = self.config
        limits = httpx.Limits(max_connections=cfg.sessions + 4, max_keepalive_connections=None)
        async with httpx.AsyncClient(
            base_url=cfg.url, timeout=cfg.timeout, limits=limits
        ) as client:
            self.t0 = time.perf_counter()
            deadline = None if cfg.duration is None else self.t0 + cfg.duration
            await asyncio.gather(*(self.agent(client, i, deadline) for i in range(cfg.sessions)))
            wall = time.perf_counter() - self.t0
            compare = await self.probe(client) if cfg.compare > 0 else None
        return report(cfg, self.samples, wall, compare)


def report(
    cfg: LoadConfig, samples: list[Sample], wall: float, compare: dict[str, Any] | None
) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None and s.ttft is not None]
    errors = Counter((s.error or "no tokens").split(":")[0] for s in samples if s not in ok)
    sources = sorted({s.source for s in ok})
    tokens = sum(s.completion_tokens for s in ok)
    return {
        "config": asdict(cfg),
        "wall_seconds": wall,
        "requests": len(samples),
        "ok": len(ok),
        "errors": dict(errors),
        "throughput": {
            "requests_per_s": len(ok) / wall if wall else 0.0,
            "completion_tokens_per_s": tokens / wall if wall else 0.0,
        },
        "ttft_ms": {
            "overall": summarize([s.ttft for s in ok if s.ttft is not None]),
            "by_source": {
                src: summarize([s.ttft for s in ok if s.source == src and s.ttft is not None])
                for src in sources
            },
        },
        "itl_ms": {
            "overall": summarize([x for s in ok for x in s.itl]),
            "by_source": {
                src: summarize([x for s in ok if s.source == src for x in s.itl]) for src in sources
            },
        },
        "prompt_tokens_p50_by_source": {
            src: percentile([float(s.prompt_tokens) for s in ok if s.source == src], 50)
            for src in sources
        },
        "compare": compare,
        "samples": [asdict(s) for s in samples],
    }


def format_report(result: dict[str, Any]) -> str:
    """The human-readable table printed after a run."""

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:8.1f}"

    lines = [
        f"requests {result['requests']}  ok {result['ok']}  errors {sum(result['errors'].values())}"
        f" {result['errors'] or ''}  wall {result['wall_seconds']:.1f}s",
        f"throughput {result['throughput']['requests_per_s']:.2f} req/s, "
        f"{result['throughput']['completion_tokens_per_s']:.1f} tokens/s",
        "",
        f"{'latency (ms)':<22}{'n':>7}{'p50':>9}{'p95':>9}{'p99':>9}",
    ]
    for metric in ("ttft_ms", "itl_ms"):
        rows = [("overall", result[metric]["overall"])]
        rows += sorted(result[metric]["by_source"].items())
        for name, s in rows:
            label = f"{metric[:-3].upper()} {name}"
            lines.append(f"{label:<22}{s['n']:>7}{f(s['p50'])}{f(s['p95'])}{f(s['p99'])}")
    c = result.get("compare")
    if c and c["n"]:
        r, p = c["restore_ttft_ms"], c["recompute_ttft_ms"]
        lines += [
            "",
            f"same prompts, one at a time ({c['n']} probes, median {c['prompt_tokens_p50']:.0f} "
            f"prompt tokens, restored from {c['restore_sources']}):",
            f"  TTFT p50 restore {r['p50']:.1f} ms vs recompute {p['p50']:.1f} ms"
            f"  -> restore is {c['speedup_p50']:.2f}x "
            + ("faster" if (c["speedup_p50"] or 0) > 1 else "NOT faster"),
        ]
        if not set(c["restore_sources"]) & set(RESTORED):
            lines.append("  (no probe was served from the cache: is the server's cache off?)")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> None:
    """TTFT over time coloured by restore source, and the TTFT distribution per source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [s for s in result["samples"] if s["ttft"] is not None and s["error"] is None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    by_src: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        by_src.setdefault(s["source"], []).append(s)
    for src, rows in sorted(by_src.items()):
        ax1.scatter([r["start"] for r in rows], [r["ttft"] * 1000 for r in rows], s=8, label=src)
        ttfts = sorted(r["ttft"] * 1000 for r in rows)
        ax2.plot(ttfts, [(k + 1) / len(ttfts) for k in range(len(ttfts))], label=src)
    ax1.set(xlabel="request start (s)", ylabel="TTFT (ms)", title="TTFT by restore source")
    ax1.set_yscale("log")
    ax2.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax2.set_xscale("log")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(config: LoadConfig) -> dict[str, Any]:
    return asyncio.run(Fleet(config).run())
