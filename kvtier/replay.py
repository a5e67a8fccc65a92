"""`kvtier replay`: a request trace (Mooncake's format, kvtier.trace) against a running server.

Each turn is sent at its time in the trace (scaled by `speed`) as a streamed `/v1/completions`
whose prompt is token ids (each block of the trace a fixed run of ids, so equal blocks give
equal prompts), with `max_tokens` the trace's reply length. A conversation's turns go under one
`X-Session-ID`, one after another: a turn whose conversation is still waiting for its previous
reply starts when that reply ends (the lag is recorded). Every conversation shares one tenant,
fresh for each run, so blocks shared across conversations are found by prefix sharing and a
second run finds nothing of the first.

With `prefetch_ahead` S, a returning turn's session is asked to read its stored K/V into L2
(`POST /v1/sessions/{id}/prefetch`, an admin route) S seconds before the turn is due, so that its
L3 reads overlap the wait rather than the turn; the turn itself still goes at its time.

The result is `kvtier loadgen`'s (latency by restore source, server-side TTFT, the tiers'
counters over the run) with the trace's own figures beside it (kvtier.replay_report).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtier import trace
from kvtier.loadgen import Sample, scrape_metrics, take_event
from kvtier.loadgen_metrics import server_ttft
from kvtier.loadgen_report import report, tiers_during
from kvtier.replay_report import prefetch_summary, replay_summary

SOURCE_HEADER = "x-kvtier-restore-source"


@dataclass(frozen=True)
class ReplayConfig:
    trace: str
    url: str = "http://127.0.0.1:8000"
    speed: float = 1.0
    sample: float = 1.0
    seed: int = 0  # which conversations --sample keeps, and the tokens of each block
    max_input: int | None = None  # prompt tokens at most; the server's context bounds it too
    max_output: int | None = None
    duration: float | None = None  # replay only the turns due in the first seconds
    ignore_eos: bool = True  # every reply runs to the trace's length
    model: str = "default"
    tenant: str | None = None  # None: replay-<run_id>
    api_key: str | None = None
    timeout: float = 600.0
    prefetch_ahead: float = 0.0  # seconds before a returning turn to prefetch its session; 0: off
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


@dataclass
class TurnSample(Sample):
    """One replayed turn: loadgen's Sample with the trace's side of it."""

    line: int = 0  # the trace's line
    due: float = 0.0  # seconds from the start, as the trace (scaled) has it
    e2e: float | None = None  # request sent to its last token
    sent_tokens: int = 0  # the prompt as sent
    ideal_cached: int = 0
    cut: int = 0  # prompt tokens --max-input left out
    prefetch: str | None = None  # "ok", or why the prefetch before it failed; None: none sent


class ServerInfo:
    """What the replay needs to know of the server: its context and vocabulary."""

    def __init__(self, max_model_len: int, vocab_size: int) -> None:
        self.max_model_len, self.vocab_size = max_model_len, vocab_size


async def server_info(client: httpx.AsyncClient, model: str) -> ServerInfo:
    resp = await client.get(f"/v1/models/{model}")
    if resp.status_code != 200:
        raise RuntimeError(f"GET /v1/models/{model} answered {resp.status_code}: {resp.text[:200]}")
    card = resp.json()
    ctx, vocab = card.get("max_model_len"), card.get("vocab_size")
    if not ctx or not vocab:
        raise RuntimeError(
            f"the server's model card gives no max_model_len or vocab_size ({card}); "
            "kvtier replay needs both (kvtier serve gives them)"
        )
    return ServerInfo(int(ctx), int(vocab))


def _progress(total: int) -> contextlib.AbstractContextManager[Callable[[], None]]:
    @contextlib.contextmanager
    def bar() -> Iterator[Callable[[], None]]:
        if not sys.stderr.isatty():
            yield lambda: None
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        cols = ("replaying turns", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*cols, console=Console(stderr=True), transient=True) as p:
            task = p.add_task("turns", total=total)
            yield lambda: p.advance(task)

    return bar()


class Replay:
    def __init__(self, config: ReplayConfig, requests: list[trace.Request]) -> None:
        self.config = config
        self.requests = requests
        self.tenant = config.tenant or f"replay-{config.run_id}"
        self.samples: list[TurnSample] = []
        self.metrics_error: str | None = None
        self.t0 = 0.0

    def headers(self, session: int) -> dict[str, str]:
        h = {"X-Session-ID": f"rp-{self.config.run_id}-{session}"}
        if not self.config.api_key:
            h["X-Tenant"] = self.tenant
        return h

    async def turn(
        self,
        client: httpx.AsyncClient,
        t: trace.Turn,
        tokens: trace.Tokens,
        after: asyncio.Event | None,
        done: asyncio.Event,
        tick: Callable[[], None],
    ) -> None:
        prefetch = None
        try:
            if after is not None:
                await after.wait()  # the conversation's previous reply
                if self.config.prefetch_ahead > 0:
                    prefetch = asyncio.create_task(self.prefetch(client, t))
            await asyncio.sleep(max(0.0, self.t0 + t.at - time.perf_counter()))
            r = t.request
            blocks = r.blocks[: -(-t.input_tokens // trace.BLOCK_TOKENS)]
            ids = tokens.prompt(blocks, t.input_tokens)
            s = TurnSample(
                r.session, r.line, time.perf_counter() - self.t0, line=r.line, due=t.at, sent_tokens=t.input_tokens,
                ideal_cached=t.ideal_cached, cut=t.cut, host=self.config.url,
            )  # fmt: skip
            self.samples.append(s)
            await self.send(client, ids, t.output_tokens, s, self.headers(r.session))
            if prefetch is not None:
                s.prefetch = await prefetch
        finally:
            done.set()
            tick()

    async def prefetch(self, client: httpx.AsyncClient, t: trace.Turn) -> str | None:
        """`prefetch_ahead` seconds before the returning turn `t` is due, ask the server to read
        its session's stored K/V into L2. "ok", or why not; None when the turn was due before
        its previous reply ended (nothing is ahead of it then)."""
        lead = self.t0 + t.at - time.perf_counter()
        if lead <= 0:
            return None
        await asyncio.sleep(max(0.0, lead - self.config.prefetch_ahead))
        sid = self.headers(t.request.session)["X-Session-ID"]
        params = {} if self.config.api_key else {"tenant": self.tenant}
        try:
            rsp = await client.post(f"/v1/sessions/{sid}/prefetch", params=params)
        except httpx.HTTPError as exc:
            return type(exc).__name__
        return "ok" if rsp.status_code == 200 else f"http {rsp.status_code}"

    async def send(
        self,
        client: httpx.AsyncClient,
        ids: list[int],
        max_tokens: int,
        s: TurnSample,
        headers: dict[str, str],
    ) -> None:
        body: dict[str, Any] = {
            "model": self.config.model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        sent = last = time.perf_counter()
        try:
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as rsp:
                s.status = rsp.status_code
                if rsp.status_code != 200:
                    raw = await rsp.aread()
                    s.error = f"http {rsp.status_code}: {raw[:200].decode(errors='replace')}"
                    return
                s.source = rsp.headers.get(SOURCE_HEADER, "unknown")
                async for line in rsp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if take_event(s, event):
                        break
                    if any(c.get("text") is not None for c in event.get("choices", [])):
                        now = time.perf_counter()
                        if s.ttft is None:
                            s.ttft = now - sent
                        else:
                            s.itl.append(now - last)
                        last = now
            s.e2e = last - sent if s.ttft is not None else None
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            s.error = f"{type(exc).__name__}: {exc}"

    async def metrics(self, client: httpx.AsyncClient) -> str | None:
        text, error = await scrape_metrics(client)
        if error is not None:
            self.metrics_error = error
        return text

    async def run(self) -> dict[str, Any]:
        cfg = self.config
        auth = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(
            base_url=cfg.url, timeout=cfg.timeout, limits=limits, headers=auth
        ) as client:
            info = await server_info(client, cfg.model)
            # a prompt leaves room for one reply token at least
            longest = info.max_model_len - 1
            max_input = min(cfg.max_input or longest, longest)
            sl = trace.Slice(
                cfg.sample, cfg.seed, cfg.duration, cfg.speed, max_input, cfg.max_output
            )
            turns = [
                trace.Turn(
                    t.request,
                    t.at,
                    t.input_tokens,
                    min(t.output_tokens, info.max_model_len - t.input_tokens),
                    t.cut,
                    t.ideal_cached,
                )
                for t in trace.select(self.requests, sl)
            ]
            tokens = trace.Tokens(info.vocab_size, cfg.seed)
            before = await self.metrics(client)
            self.t0 = time.perf_counter()
            last_of: dict[int, asyncio.Event] = {}
            tasks = []
            with _progress(len(turns)) as tick:
                for t in turns:
                    done = asyncio.Event()
                    after = last_of.get(t.request.session)
                    last_of[t.request.session] = done
                    tasks.append(
                        asyncio.create_task(self.turn(client, t, tokens, after, done, tick))
                    )
                await asyncio.gather(*tasks)
            wall = time.perf_counter() - self.t0
            after_text = await self.metrics(client)
        server = tiers = None
        if after_text is not None:
            try:
                server = server_ttft(before, after_text)
                tiers = tiers_during(before, after_text)
            except ValueError as exc:
                self.metrics_error = f"/metrics is not Prometheus text: {exc}"
        self.samples.sort(key=lambda s: s.line)
        result = report(cfg, self.samples, wall, None, server, tiers, self.metrics_error)
        result["replay"] = replay_summary(turns, self.samples, wall, info.max_model_len, sl)
        result["replay"]["prefetch"] = prefetch_summary(self.samples, cfg.prefetch_ahead)
        return result


def run(config: ReplayConfig) -> dict[str, Any]:
    """Replay `config.trace`; TraceError when a line of it cannot be read."""
    requests = trace.load(Path(config.trace))
    return asyncio.run(Replay(config, requests).run())
