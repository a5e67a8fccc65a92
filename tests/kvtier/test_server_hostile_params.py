"""Parameters that once gave a 500, invalid JSON or an id that no route could reach, against a
real `kvtier serve` (the built-in model): each is now a 200 with valid JSON or a 400 that says
what to send, and ids with `/` are reachable by every admin route."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_proc import Server

from kvtier.server.http.schema import MAX_STOPS

SMALL = ("--l1-bytes", "32MiB", "--l2-bytes", "32MiB")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("hostile") / "l3", *SMALL).start()
    yield srv
    assert srv.stop() == 0, srv.output()


def _chat(url: str, **more: Any) -> httpx.Response:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "name three colours"}],
        "max_tokens": 12,
        **more,
    }
    headers = more.pop("headers", None) or {}
    body.pop("headers", None)
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def _strict(text: str) -> Any:
    """JSON as the standard reads it: NaN and Infinity are refused."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_tiny_temperature_is_greedy_not_a_500(server: Server) -> None:
    greedy = _chat(server.url, temperature=0)
    tiny = _chat(server.url, temperature=1e-40)
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]


def test_an_out_of_range_seed_is_a_400(server: Server) -> None:
    r = _chat(server.url, temperature=0.7, seed=2**64)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "seed"
    assert _chat(server.url, temperature=0.7, seed=2**63 - 1).status_code == 200


def test_logprobs_with_a_grammar_are_valid_json_whole_and_streamed(server: Server) -> None:
    more: dict[str, Any] = {
        "response_format": {"type": "json_object"},
        "logprobs": True,
        "top_logprobs": 5,
        "max_tokens": 8,
    }
    r = _chat(server.url, **more)
    assert r.status_code == 200, r.text
    body = _strict(r.text)
    for entry in body["choices"][0]["logprobs"]["content"]:
        assert entry["logprob"] > -1e4
        assert all(t["logprob"] > -1e4 for t in entry["top_logprobs"])
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={
            "model": "default",
            "messages": [{"role": "user", "content": "name three colours"}],
            "stream": True,
            **more,
        },
        timeout=60,
    ) as s:
        events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for data in events[:-1]:
        _strict(data)  # no -Infinity in any chunk


def test_too_many_or_too_long_stop_strings_are_a_400(server: Server) -> None:
    r = _chat(server.url, stop=[f"s{i}" for i in range(MAX_STOPS + 1)])
    assert r.status_code == 400 and "stop" in r.json()["error"]["message"], r.text
    r = _chat(server.url, stop=["x" * 10_000])
    assert r.status_code == 400 and "at most" in r.json()["error"]["message"], r.text
    assert _chat(server.url, stop=[f"s{i}" for i in range(MAX_STOPS)]).status_code == 200


def test_ids_with_a_slash_reach_every_admin_route(server: Server) -> None:
    tenant, sid = "org/team", "org/team/s-1"
    headers = {"X-Tenant": tenant, "X-Session-ID": sid}
    assert _chat(server.url, headers=headers).status_code == 200
    for op in ("hibernate", "prefetch"):
        r = httpx.post(f"{server.url}/v1/sessions/{sid}/{op}", params={"tenant": tenant})
        assert r.status_code == 200, (op, r.text)
    encoded = sid.replace("/", "%2F")
    r = httpx.delete(f"{server.url}/v1/sessions/{encoded}", params={"tenant": tenant})
    assert r.status_code == 200 and r.json()["id"] == sid, r.text
    assert _chat(server.url, headers=headers).status_code == 200
    r = httpx.delete(f"{server.url}/v1/tenants/{tenant}")
    assert r.status_code == 200 and r.json()["id"] == tenant, r.text
