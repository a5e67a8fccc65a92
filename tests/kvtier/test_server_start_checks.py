"""Settings that cannot work stop `kvtier serve` at start, in one line (issue 40), and one that
can work starts well: an L2 larger than the host's memory and a configuration error at load
exit non-zero (as a held L3 root does) instead of staying up never ready; a port in use fails
before the model loads or an L3 root is created; one batch slot warms up like any other."""

from __future__ import annotations

import dataclasses
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from server_proc import ROOT, free_port
from test_server_startup import _config, _InProcess

from kvtier.errors import BudgetError, ConfigError
from kvtier.server.config import ServerConfig
from kvtier.server.http import listen
from kvtier.server.http.app import create_app

SMALL = ["--l1-bytes", "32MiB", "--l3-writer", "threads", "--log-level", "warning"]


def _serve(
    l3: Path, *args: str, timeout: float = 120.0, banner: bool = False
) -> tuple[int | None, list[str]]:
    """Run `kvtier serve` until it exits or `timeout` passes (then kill it: exit status None);
    its stderr lines but the start banner (with it, when `banner`)."""
    cmd = [sys.executable, "-m", "ops.cli", "serve", "--l3-root", str(l3), *SMALL, *args]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:  # still up: the defect this file is about
        proc.kill()
        _, err = proc.communicate()
        code = None
    text = err.decode(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return code, [ln for ln in lines if banner or not ln.startswith("kvtier serve: http")]


# ---- B: a setting that cannot work exits -------------------------------------------------------


def test_an_l2_larger_than_the_hosts_memory_exits_with_one_line(tmp_path: Path) -> None:
    """`--l2-bytes` past the host's memory used to log a BudgetError and stay up, /readyz
    "failed" and every request 503; now the process exits 1 with the error's one line."""
    port = free_port()
    code, lines = _serve(tmp_path / "l3", "--port", str(port), "--l2-bytes", "64TiB")
    assert code == 1, lines
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith("kvtier serve: BudgetError: L2 wants "), lines
    assert "lower l2_bytes" in lines[0]


def _load_failure(config: ServerConfig, loader: object = None) -> BaseException | None:
    """Run the app's start (its lifespan) until the fatal hook stops it; the fatal error."""
    app = create_app(config, **({"loader": loader} if loader is not None else {}))
    state = app.state.kvtier
    stopped = threading.Event()
    state.stop = stopped.set  # run.run_app's: stop uvicorn
    with TestClient(app):
        assert stopped.wait(120), f"not stopped; load_error={state.load_error!r}"
    assert state.load_error is state.fatal_error
    fatal: BaseException | None = state.fatal_error
    return fatal


def test_a_config_or_budget_error_at_load_stops_the_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="kvtier.server")
    wrong = ConfigError("--devices 7: no such GPU; pass ordinals of this host's GPUs")

    def loader(config: ServerConfig) -> object:
        raise wrong

    assert _load_failure(_config(tmp_path / "a"), loader) is wrong
    assert not [r for r in caplog.records if r.exc_info]  # one line at exit, no traceback
    too_big = dataclasses.replace(_config(tmp_path / "b"), l2_bytes=64 << 40)
    assert isinstance(_load_failure(too_big), BudgetError)


# ---- C: a port in use fails before anything loads ----------------------------------------------


def test_a_port_in_use_exits_before_loading_the_model_or_touching_l3(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        code, lines = _serve(
            tmp_path / "l3", "--port", str(port), "--l2-bytes", "32MiB", banner=True
        )
        elapsed = time.monotonic() - started
    assert code == 1, lines  # and no banner announced a server that never served
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith(f"kvtier serve: port {port} (127.0.0.1:{port}) is already in use")
    assert "--port" in lines[0] and "nothing was loaded" in lines[0]
    assert not (tmp_path / "l3").exists()  # no L3 root was created
    assert elapsed < 60, elapsed


def test_bind_takes_every_address_and_names_a_taken_port() -> None:
    taken = listen.bind("127.0.0.1", 0)
    try:
        port = taken[0].getsockname()[1]
        with pytest.raises(listen.PortUnavailable, match=f"port {port} .* already in use"):
            listen.bind("127.0.0.1", port)
    finally:
        for sock in taken:
            sock.close()
    again = listen.bind("127.0.0.1", port)  # closed: free again (SO_REUSEADDR)
    for sock in again:
        sock.close()
    with pytest.raises(listen.PortUnavailable, match="--host"):
        listen.bind("no-such-host.invalid", 0)


# ---- D: one batch slot --------------------------------------------------------------------------


def test_one_slot_warms_up_fully_and_serves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--max-concurrency 1 used to fail the warm-up ("2 sequences exceed max_batch=1"), which
    then skipped the CUDA graph capture and the batched prefill's measurement."""
    caplog.set_level(logging.INFO, logger="kvtier.server")
    config = dataclasses.replace(_config(tmp_path / "l3"), max_concurrency=1)
    srv = _InProcess(config).start()
    try:
        failed = [
            r.getMessage()
            for r in caplog.records
            if r.name == "kvtier.server" and r.levelno >= logging.WARNING
        ]
        assert failed == [], failed
        engine = srv.state.engine
        assert engine._batch is not None and engine._batch.runner.max_batch == 1
        body = {"model": "default", "prompt": "one slot", "max_tokens": 2}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


# ---- D: a server that cannot serve exits, saying why -------------------------------------------


def test_an_unusable_device_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    """`--device cuda` where there is no CUDA device used to print a traceback and stay up,
    /healthz 200 and /readyz 503 without a reason; a supervisor never restarted it."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    started = time.monotonic()
    code, lines = _serve(tmp_path / "l3", "--port", str(free_port()), "--device", "cuda")
    assert code == 1, lines
    assert time.monotonic() - started < 120
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith("kvtier serve: "), lines


def test_readyz_gives_the_reason_while_a_failed_load_stops(tmp_path: Path) -> None:
    broken = RuntimeError("the checkpoint is truncated at tensor 17")

    def loader(config: ServerConfig) -> object:
        raise broken

    app = create_app(_config(tmp_path), loader=loader)
    state = app.state.kvtier
    stopped = threading.Event()
    state.stop = stopped.set
    with TestClient(app) as client:
        assert stopped.wait(60)
        ready = client.get("/readyz")
    assert state.fatal_error is broken
    assert ready.status_code == 503
    assert ready.json() == {
        "status": "failed",
        "reason": "RuntimeError: the checkpoint is truncated at tensor 17",
    }
