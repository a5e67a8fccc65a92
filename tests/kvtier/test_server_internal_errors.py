"""An internal error never drops a connection: a non-streamed request gets an OpenAI-shaped
JSON error (500), a streamed one ends with an error event and `data: [DONE]`, and the server
serves the next request. The fault is raised by the real model's forward, in the batch's step.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server_startup import _config, _InProcess


@pytest.fixture
def server(tmp_path: Path) -> Iterator[_InProcess]:
    srv = _InProcess(_config(tmp_path / "l3")).start()
    try:
        yield srv
    finally:
        srv.stop()


def _chat(model: str, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "status?"}],
        "max_tokens": 4,
        "stream": stream,
    }


def test_an_internal_error_answers_json_or_ends_the_stream(server: _InProcess) -> None:
    name = server.state.config.served_model_name
    engine = server.state.engine
    assert engine is not None
    model = engine.served.model

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a planted fault in the forward")

    model.forward = broken  # an instance attribute: nn.Module.__call__ runs it
    try:
        whole = httpx.post(server.url + "/v1/chat/completions", json=_chat(name, False), timeout=60)
        assert whole.status_code == 500, whole.text
        err = whole.json()["error"]
        assert err["type"] == "server_error" and "RuntimeError" in err["message"]
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json=_chat(name, True), timeout=60
        ) as r:
            assert r.status_code == 200
            events = [ln[len("data: ") :] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        last = json.loads(events[-2])
        assert last["error"]["type"] == "server_error", last
    finally:
        del model.forward
    ok = httpx.post(server.url + "/v1/chat/completions", json=_chat(name, False), timeout=60)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["role"] == "assistant"
