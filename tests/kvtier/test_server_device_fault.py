"""A device fault that loses the CUDA context stops the server (kvtier.server.devices.devicefault).

On CUDA, a device-side assert or an illegal memory access leaves every later call on the device
failing. The server must then not answer 500 to every request while /readyz says ready: the
engine marks itself failed, /readyz answers 503 with the reason, and the app's fatal hook stops
the server (run.run_app then exits 1 with one line). Here, on the CPU, the fault is injected into
the batch scheduler's step (or the per-request worker's forward) as torch raises it; an ordinary
error in the same place fails its request only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from kvtier.errors import KvtierError
from kvtier.server.batch.engine import Engine
from kvtier.server.config import ServerConfig
from kvtier.server.devices.devicefault import DeviceFault, is_fatal_device_error
from kvtier.server.http.app import create_app

ILLEGAL = "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be..."
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_which_errors_lose_the_device() -> None:
    assert is_fatal_device_error(RuntimeError(ILLEGAL))
    assert is_fatal_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_fatal_device_error(RuntimeError("...: an illegal memory access was encountered"))
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None:
        assert is_fatal_device_error(accelerator("CUDA error: unspecified launch failure"))
    wrapped = KvtierError("the copy failed")
    wrapped.__cause__ = RuntimeError(ILLEGAL)
    assert is_fatal_device_error(wrapped)  # raised from one
    # recoverable: out of memory (the next request may fit), and everything else
    assert not is_fatal_device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to..."))
    assert not is_fatal_device_error(RuntimeError("CUDA error: out of memory"))
    assert not is_fatal_device_error(RuntimeError("shape mismatch: [2, 3] and [4]"))
    assert not is_fatal_device_error(ValueError("CUDA error: not a RuntimeError"))
    assert not is_fatal_device_error(KvtierError("CUDA error in a message of kvtier's own"))
    # one line that says what to do; torch's debugging advice is left out
    message = str(DeviceFault.of(RuntimeError(ILLEGAL)))
    assert "\n" not in message and "illegal memory access" in message and "restart" in message


def test_a_model_placed_across_devices_is_left_to_its_failover() -> None:
    heard: list[BaseException] = []
    engine: Any = SimpleNamespace(
        served=SimpleNamespace(devices=object()),
        fatal=None,
        on_fatal=heard.append,
        _fatal_lock=threading.Lock(),
    )
    assert Engine.device_fault(engine, RuntimeError(ILLEGAL)) is False
    assert engine.fatal is None and heard == []


class _Served:
    """The app on the built-in model, in this process (TestClient), with its fatal hook seen."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.state = client.app.state.kvtier  # type: ignore[attr-defined]
        self.stopped = threading.Event()
        self.state.stop = self.stopped.set  # run.run_app's: stop uvicorn

    @property
    def engine(self) -> Engine:
        engine = self.state.engine
        assert engine is not None
        return engine

    def readyz(self) -> tuple[int, dict[str, Any]]:
        r = self.client.get("/readyz")
        return r.status_code, r.json()


def _wait_ready(client: TestClient, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = client.app.state.kvtier  # type: ignore[attr-defined]
        assert state.load_error is None, state.load_error
        if client.get("/readyz").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("the server did not become ready")


@pytest.fixture(params=[True, False], ids=["batch", "per-request"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[_Served]:
    config = ServerConfig(
        l3_root=tmp_path / "l3",
        device="cpu",
        l2_bytes=32 * 2**20,
        l3_writer="threads",
        log_level="warning",
        batching=request.param,
    )
    # a 500 stays a response (the app's handler answers it), not an exception in the test
    with TestClient(create_app(config), raise_server_exceptions=False) as client:
        _wait_ready(client)
        yield _Served(client)


def _inject(s: _Served, monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    """Make the model's next forward raise `exc`: the batch's step, or the worker's forward."""

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc

    engine = s.engine
    if engine.batching:
        assert engine._batch is not None  # started by the warm-up
        monkeypatch.setattr(engine._batch.runner, "step", fail)
    else:
        monkeypatch.setattr(engine, "_forward", fail)


def test_a_device_fault_stops_the_server_and_readyz_says_why(
    served: _Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    _inject(served, monkeypatch, RuntimeError(ILLEGAL))
    r = served.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500, r.text  # this request's answer
    assert served.stopped.wait(10), "the fatal hook was not called"
    fatal = served.state.fatal_error
    assert isinstance(fatal, DeviceFault) and "illegal memory access" in str(fatal)
    assert served.engine.fatal is fatal
    status, body = served.readyz()
    assert status == 503 and body["status"] == "failed", body
    assert "illegal memory access" in body["reason"]
    # nothing more reaches the lost device
    monkeypatch.undo()
    r = served.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and "restart" in r.json()["error"]["message"], r.text


def test_an_ordinary_error_fails_its_request_only(
    served: _Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    for exc in (RuntimeError("shape mismatch"), torch.OutOfMemoryError("CUDA out of memory")):
        _inject(served, monkeypatch, exc)
        r = served.client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 500, r.text
        monkeypatch.undo()
    assert not served.stopped.is_set() and served.state.fatal_error is None
    assert served.engine.fatal is None
    assert served.readyz() == (200, {"status": "ready", "model": "default"})
    r = served.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
