"""A live exporter for kvtop's end-to-end test and fixture recording: a real TieredCache on a
tiny random Llama, driven by agent-like sessions, served by the real exporter on loopback."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import torch

from kvtier.integrations.hf import cache_kwarg


@dataclass
class Live:
    url: str
    cache: Any
    stop: threading.Event  # set: the workload pauses (numbers on /metrics stop moving)
    errors: list[BaseException]
    session_id: str = "agent-{i}"  # the ids of the six sessions, formatted with i = 0..5


def _workload(live: Live, model: Any, quit_: threading.Event) -> None:
    """Sessions of two tenants: a turn, a tool-call pause (hibernate), the next turn; repeat."""
    try:
        turn = 0
        while not quit_.is_set():
            if live.stop.is_set():
                quit_.wait(0.05)
                continue
            for i in range(6):
                tenant = "acme" if i % 2 else "globex"
                s = live.cache.session(live.session_id.format(i=i), tenant=tenant)
                ids = torch.tensor([[1 + i] + [5, 9, 13, 2] * (6 + (turn + i) % 7)])
                pkv = s.restore(ids)
                out = model.generate(
                    ids,
                    **{cache_kwarg(model): pkv},
                    max_new_tokens=3,
                    do_sample=False,
                    pad_token_id=0,
                )
                s.commit(out)
                if (i + turn) % 2:
                    s.hibernate()
                if i == 5:
                    s.pin()
            turn += 1
    except BaseException as exc:  # reported by the caller, never swallowed
        live.errors.append(exc)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def _serve(registry: Any, cache: Any) -> Any:
    """/metrics from the exporter's registry, and /v1/sessions in kvtier serve's JSON shape
    (the same `dataclasses.asdict` of `cache.stats().sessions` the server's endpoint returns)."""
    from prometheus_client import make_wsgi_app

    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start: Any) -> Any:
        if environ.get("PATH_INFO") == "/v1/sessions":
            rows = [dataclasses.asdict(s) for s in cache.stats().sessions]
            body = json.dumps({"object": "list", "data": rows}).encode()
            start("200 OK", [("Content-Type", "application/json")])
            return [body]
        return metrics(environ, start)

    server = make_server("127.0.0.1", 0, app, server_class=_Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@contextmanager
def live_exporter(tmp: Path, session_id: str = "agent-{i}") -> Iterator[Live]:
    """The exporter (cache + host collectors, l3_root set) on 127.0.0.1, workload running;
    `session_id` formats the sessions' ids (`lg-ca4283a0-{i:05d}`: ids as loadgen makes them)."""
    from kvtier import CacheConfig, TieredCache
    from kvtier.server.devices.model import build_default
    from ops.exporter import make_registry

    model = build_default("cpu").model  # the server's built-in random Llama
    cache = TieredCache(
        CacheConfig(
            l3_root=tmp / "l3",
            l1_bytes=1 << 20,
            l2_bytes=1 << 20,
            chunk_tokens=16,
            pin_memory=False,
        ),
        model,
    )
    registry = make_registry(cache.stats, tmp / "l3", nvml=False)
    server = _serve(registry, cache)
    live = Live(f"http://127.0.0.1:{server.server_port}", cache, threading.Event(), [], session_id)
    quit_ = threading.Event()
    worker = threading.Thread(target=_workload, args=(live, model, quit_), daemon=True)
    worker.start()
    try:
        yield live
    finally:
        quit_.set()
        worker.join(timeout=30)
        server.shutdown()
        cache.close()
