"""Request bodies: a misspelt field is named, and the accepted fields are listed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from kvtier.server.config import ServerConfig
from kvtier.server.http.schema import ChatRequest, CompletionRequest

HELLO = [{"role": "user", "content": "hi"}]


def first_error(model: Any, body: dict[str, Any]) -> Any:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return info.value.errors()[0]


def test_misspelt_required_field_is_reported_as_the_unknown_field() -> None:
    # pydantic finds two problems: `messages` missing and `mesages` unknown. The typo comes first.
    err = first_error(ChatRequest, {"model": "default", "mesages": HELLO})
    assert (err["type"], err["loc"]) == ("extra_forbidden", ("mesages",))
    err = first_error(CompletionRequest, {"model": "default", "promt": "hi"})
    assert (err["type"], err["loc"]) == ("extra_forbidden", ("promt",))


def test_other_errors_are_kept_whole_and_in_order() -> None:
    with pytest.raises(ValidationError) as info:
        ChatRequest.model_validate({"mesages": HELLO, "temperature": 5})
    got = [(e["type"], e["loc"]) for e in info.value.errors()]
    assert got == [
        ("extra_forbidden", ("mesages",)),
        ("missing", ("model",)),
        ("less_than_equal", ("temperature",)),
        ("missing", ("messages",)),
    ]
    assert info.value.errors()[2]["ctx"] == {"le": 2.0}
    # No unknown field: pydantic's own first error stays first.
    err = first_error(ChatRequest, {"model": "default", "messages": HELLO, "top_p": 0})
    assert err["loc"] == ("top_p",) and err["type"] == "greater_than"
    # A valid body still validates.
    assert ChatRequest.model_validate({"model": "default", "messages": HELLO}).messages


def test_http_app_names_the_typo_and_lists_the_accepted_fields(tmp_path: Path) -> None:
    from kvtier.server.http.app import create_app

    # No lifespan runs here: no model loads; bodies are validated before the model is needed.
    app = create_app(ServerConfig(l3_root=tmp_path / "l3"))

    async def post(body: dict[str, Any]) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/chat/completions", json=body)

    r = asyncio.run(post({"model": "default", "mesages": HELLO}))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "unknown field 'mesages'" in message, message
    assert "messages" in message.split("accepts:")[1] and "max_tokens" in message
    assert "Field required" not in message
