"""An agent framework's turn through `kvtier serve`, driven by the openai client: a tool loop
whose every turn restores from the cache, structured output, logprobs, penalties and the
requests an agent may send by mistake."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from server_proc import Server

pytest.importorskip("xgrammar")

SMALL = ("--l1-bytes", "32MiB", "--l2-bytes", "32MiB")
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 999},
                "y": {"type": "integer", "minimum": 0, "maximum": 999},
            },
            "required": ["x", "y"],
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"kind": {"enum": ["file", "web"]}},
            "required": ["kind"],
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = Server(tmp_path_factory.mktemp("agent") / "l3", "--max-concurrency", "4", *SMALL).start()
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_a_five_step_tool_loop_restores_every_turn_from_the_cache(client: openai.OpenAI) -> None:
    """Each turn must call a tool (tool_choice required); the client runs it and sends the
    result back. Every turn after the first starts from the cache with all of the previous
    turn's prompt and reply: the rendered prompt of turn N+1 extends turn N's token for token."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent. Use the tools."},
        {"role": "user", "content": "add some numbers, then look things up"},
    ]
    previous = None
    for step in range(5):
        raw = client.chat.completions.with_raw_response.create(
            model="default",
            messages=messages,  # type: ignore[arg-type]
            tools=[ADD, LOOKUP],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=step,
            max_tokens=200,
            extra_headers={"X-Session-ID": "tool-loop"},
        )
        out = raw.parse()
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].function.name in ("add", "lookup")
        args = json.loads(calls[0].function.arguments)
        usage = out.usage
        assert usage is not None
        if previous is None:
            assert raw.headers["x-kvtier-restore-source"] == "recompute"
        else:
            assert raw.headers["x-kvtier-restore-source"] in ("l1", "l2"), raw.headers
            # the reply's last token (the end token) is sampled but never fed: no K/V for it
            fed = previous.prompt_tokens + previous.completion_tokens - 1
            assert usage.prompt_tokens_details.cached_tokens == fed, (usage, previous)
        previous = usage
        messages.append(choice.message.model_dump(exclude_none=True))
        result = args["x"] + args["y"] if calls[0].function.name == "add" else "found it"
        messages.append(
            {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"r": result})}
        )


def test_a_streamed_named_tool_call(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "look it up"}],
        tools=[ADD, LOOKUP],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        temperature=1.0,
        seed=3,
        max_tokens=100,
        stream=True,
    )
    content, calls, reasons = "", [], []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    assert content == ""  # the call's text is not streamed as content
    assert len(calls) == 1 and calls[0].function.name == "lookup"
    assert json.loads(calls[0].function.arguments)["kind"] in ("file", "web")
    assert reasons[-1] == "tool_calls"


def test_json_schema_response_format(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["city", "days", "tags"],
    }
    for seed in range(3):
        out = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "plan a trip"}],
            response_format={  # type: ignore[typeddict-item]
                "type": "json_schema",
                "json_schema": {"name": "trip", "schema": schema},
            },
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        data = json.loads(out.choices[0].message.content or "")
        assert data["city"] in ("Paris", "Oslo") and 1 <= data["days"] <= 9
        assert set(data["tags"]) <= {"a", "b"}
    # json_object bounds no length: with random weights a draw may still be inside a string at
    # max_tokens. Every reply that ends by itself is one JSON object; some seed's does.
    ended = 0
    for seed in range(8):
        obj = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "json please"}],
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        if obj.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
            ended += 1
    assert ended, "no json_object reply of 8 seeds ended within 200 tokens"


def test_logprobs_chat_and_completions(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 6
    text = "".join(t.token for t in lp.content)
    assert text == out.choices[0].message.content
    for t in lp.content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    text_out = client.completions.create(
        model="default", prompt="abc", max_tokens=4, temperature=0, logprobs=1
    )
    tlp = text_out.choices[0].logprobs
    assert tlp is not None and len(tlp.tokens or []) == 4
    assert tlp.text_offset == [0, 1, 2, 3]  # one byte each: the byte tokenizer


def test_sampling_fields_and_models_by_id(server: Server, client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "repeat"}],
        temperature=0,
        max_tokens=8,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.3},
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    assert client.models.retrieve("default").id == "default"
    missing = httpx.get(server.url + "/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    many = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "default", "messages": [{"role": "user", "content": "x"}], "n": 2},
    )
    assert many.status_code == 400 and "one choice per request" in many.text


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"tool_choice": "required"}, "needs `tools`"),
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "x"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ],
)
def test_bad_agent_requests_are_400s_that_say_why(
    server: Server, extra: dict[str, Any], says: str
) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "x"}], **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


def test_an_assistant_tool_call_with_arguments_that_are_not_json(server: Server) -> None:
    body = {
        "model": "default",
        "messages": [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                ],
            },
        ],
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and "arguments" in r.json()["error"]["message"]


def test_frictions_a_new_user_met(server: Server) -> None:
    """The errors name what was sent: the `user` field, a tenant with nothing stored, a body
    that is not JSON."""
    body = {"model": "default", "messages": [{"role": "user", "content": "x"}], "user": "u" * 200}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "user", r.text
    assert "X-Session-ID" not in r.json()["error"]["message"]
    gone = httpx.delete(server.url + "/v1/tenants/nobody")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "tenant_not_found"
    plain = httpx.post(
        server.url + "/v1/chat/completions",
        content=json.dumps(body),
        headers={"Content-Type": "text/plain"},
    )
    assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
