"""`kvtier serve`'s /metrics carries the serving process's own signals: prometheus_client's
`process_*` and psutil's `kvtier_process_*`, checked on a real server against psutil's view of
the same process from outside."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def _values(text: str) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


@pytest.mark.timeout(300)
def test_serve_metrics_show_the_process_as_psutil_sees_it(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    port = _free_port()
    cmd = [sys.executable, "-m", "ops.cli", "serve", "--port", str(port), "--l3-root", str(l3)]
    cmd += ["--l1-bytes", "32MiB", "--l2-bytes", "32MiB", "--l3-writer", "process"]
    cmd += ["--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env |= {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if urllib.request.urlopen(url + "/readyz", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)

        v = _values(_get(url + "/metrics"))
        me = psutil.Process(proc.pid)
        children = me.children(recursive=True)
        # prometheus_client's process collector (not registered anywhere before this)
        rss = me.memory_info().rss
        assert 0.5 * rss < v["process_resident_memory_bytes"] < 2 * rss
        assert v["process_cpu_seconds_total"] > 0
        assert v["process_open_fds"] >= 3 and v["process_max_fds"] > 0
        # psutil's: what the client lacks
        assert abs(v["kvtier_process_threads"] - me.num_threads()) <= 4
        assert v["kvtier_process_children"] == len(children) >= 1  # the L3 writer process
        child_rss = sum(c.memory_info().rss for c in children)
        assert 0.5 * child_rss < v["kvtier_process_children_resident_memory_bytes"] < 2 * child_rss
        held = [
            f.path
            for p in (me, *children)
            for f in p.open_files()
            if f.path.startswith(str(l3.resolve()) + os.sep)
        ]
        assert held, "the server holds its L3 index open"
        assert abs(v["kvtier_process_l3_open_files"] - len(held)) <= 2, held
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
