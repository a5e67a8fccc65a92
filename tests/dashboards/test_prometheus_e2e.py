"""End to end: a real Prometheus (Debian's package) on loopback scrapes the exporter while a
live TieredCache serves a multi-session workload; after two scrapes every dashboard panel
expression and every recording rule must return data through Prometheus' HTTP API.

Only one kind of expression may come back empty, and only on a host without the source: those
whose metrics docs/metrics.md lists with a host-dependent source (NVML, PCIe, CUDA allocator,
a configured L4 tier) *and* that this host's exporter did not produce. They are reported, not
hidden behind `or vector(0)`; on a GPU host the same test checks them too. A metric name that
is not in docs/metrics.md at all fails the test, so a typo in a panel can never pass as "no
GPU here". The server's own families (a GPU memory plan among them) are registered beside the
exporter's with a stand-in plan and a served turn, so their panels are checked on every host.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from kvtier.integrations.hf import cache_kwarg

REPO = Path(__file__).resolve().parents[2]
PROM = REPO / "dashboards" / "prometheus"
HOST_DEPENDENT = {"NVML", "PCIe", "CUDA allocator", "L4"}  # L4: a server with --l4-url

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="prometheus missing: `scripts/bootstrap.sh dev` installs Debian's package",
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Plan:
    """What `ServerMetrics.gpu_memory_plan` reads of a GPU memory plan (a stand-in, no GPU)."""

    budget_bytes: int = 60 << 30

    def parts(self) -> dict[str, int]:
        return {"weights": 16 << 30, "pool": 43 << 30, "headroom": 1 << 30}

    def used_bytes(self) -> int:
        return 50 << 30


def documented_sources() -> dict[str, str]:
    sources = {}
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.match(r"^`(kvtier_[a-z0-9_]+)`$", cells[0]) if cells else None
        if m and len(cells) == 6:
            sources[m.group(1)] = cells[4]
    return sources


def recording_rules() -> dict[str, str]:
    doc = yaml.safe_load((PROM / "recording.yml").read_text())
    return {r["record"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def panel_expressions() -> list[tuple[str, str]]:
    dash = json.loads((REPO / "dashboards" / "grafana" / "kvtier.json").read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"].replace("$instance", ".+").replace("$__rate_interval", "1m")
            out.append((p["title"], expr))
    return out


def metric_names(expr: str, rules: dict[str, str]) -> set[str]:
    """Exported metric names an expression depends on (through recording rules too)."""
    names: set[str] = set()
    for name in re.findall(r"kvtier[_:][a-z0-9_:]*", expr):
        if name in rules:
            names |= metric_names(rules[name], rules)
        else:
            names.add(re.sub(r"_(bucket|sum|count)$", "", name))  # a histogram's or summary's
    return names


def workload(cache, model, stop: threading.Event, errors: list[BaseException]) -> None:
    """Agent-like sessions: a turn, a tool-call pause (hibernate), the next turn; repeat."""
    try:
        turn = 0
        while not stop.is_set():
            for i in range(4):
                s = cache.session(f"agent-{i}", tenant="t")
                ids = torch.tensor([[1 + i] + [5, 9, 13, 2] * (6 + turn % 5)])
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
            turn += 1
    except BaseException as exc:  # reported by the test, never swallowed
        errors.append(exc)


def serve(metrics) -> None:
    """kvtier serve's own families with a sample each: a GPU memory plan, a response, a turn's
    tokens, TTFT and latencies (its serving panels read them)."""
    from kvtier.server.reqmetrics import TurnClock

    metrics.gpu_memory_plan(Plan())
    metrics.request("/v1/chat/completions", 200)
    metrics.ttft("recompute", 0.03)
    metrics.count("prompt_tokens", 40)
    metrics.count("completion_tokens", 3)
    clock = TurnClock(1.0, metrics)
    clock.admit(1.01)
    for at in (1.04, 1.06, 1.08):
        clock.token(at)
    clock.ended()


def query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_dashboard_and_recording_rules_return_data(tmp_path: Path) -> None:
    from prometheus_client import start_http_server

    from kvtier import CacheConfig, TieredCache
    from kvtier.server.devices.model import build_default
    from kvtier.server.metrics import ServerMetrics
    from ops.exporter import make_registry

    model = build_default("cpu").model  # the server's built-in random Llama
    l3_root = tmp_path / "l3"
    cache = TieredCache(
        CacheConfig(
            l3_root=l3_root,
            l1_bytes=1 << 20,
            l2_bytes=1 << 20,
            chunk_tokens=16,
            pin_memory=False,
        ),
        model,
    )
    stop = threading.Event()
    errors: list[BaseException] = []
    worker = threading.Thread(target=workload, args=(cache, model, stop, errors), daemon=True)
    worker.start()

    registry = make_registry(cache.stats, l3_root)
    serve(ServerMetrics(registry))  # kvtier serve's own families beside
    exporter, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    target = f"127.0.0.1:{exporter.server_port}"

    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(PROM / "recording.yml"), str(PROM / "alerts.yml")],
        "scrape_configs": [{"job_name": "kvtier", "static_configs": [{"targets": [target]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("w")
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        scrapes = 0
        while time.monotonic() < deadline:
            try:
                found = query(base, 'count_over_time(up{job="kvtier"}[5m])')
                scrapes = int(float(found[0]["value"][1])) if found else 0
                up = query(base, 'up{job="kvtier"}')
                if scrapes >= 3 and up and up[0]["value"][1] == "1":
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert scrapes >= 3, (tmp_path / "prometheus.log").read_text()[-3000:]
        time.sleep(2.5)  # let the recording rules evaluate over two scrapes

        series = query(base, '{__name__=~"kvtier_.+", job="kvtier"}')
        exported = {r["metric"]["__name__"] for r in series}
        exported = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
        sources = documented_sources()
        rules = recording_rules()
        checks = panel_expressions() + [(f"recording rule {r}", r) for r in rules]
        empty, skipped = [], []
        for title, expr in checks:
            names = metric_names(expr, rules)
            undocumented = sorted(n for n in names if n not in sources)
            assert not undocumented, f"{title}: {expr} names undocumented {undocumented}"
            absent = [n for n in names if n not in exported]
            if absent and all(sources[n] in HOST_DEPENDENT for n in absent):
                skipped.append((title, absent))  # no such source on this host, by design
                continue
            if not query(base, expr):
                empty.append((title, expr))
        assert not empty, f"expressions without data: {empty}"
        assert not errors, errors
        # The check must have covered the cache and host rows, not skipped its way to green.
        assert len(checks) - len(skipped) >= 40, (len(checks), skipped)
        skipped_sources = {sources[n] for _, absent in skipped for n in absent}
        assert skipped_sources <= HOST_DEPENDENT
        if torch.cuda.is_available():
            assert "NVML" not in skipped_sources, skipped
        print(
            f"checked {len(checks) - len(skipped)} expressions; no source on this host: {skipped}"
        )
    finally:
        stop.set()
        server.terminate()
        server.wait(timeout=30)
        log.close()
        exporter.shutdown()
        worker.join(timeout=60)
        cache.close()
