"""`ignore_eos` (vLLM's extension) through a real `kvtier serve` over HTTP, batching on and off:
the end-of-sequence token no longer ends the reply, which runs to `max_tokens`.

The built-in random model samples its end token often at temperature 1 (about one draw in
three ends within 24 tokens), so each test first finds a seed whose reply, without the flag,
ends early with `finish_reason: "stop"`, then asks again with the same seed and the flag: the
draws are the same, and only the end token's effect differs."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_proc import Server

SMALL = ("--l1-bytes", "32MiB", "--l2-bytes", "32MiB")
N = 24  # max_tokens of every reply here
PROMPT = "say something"


@pytest.fixture(scope="module", params=["--batching", "--no-batching"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    l3 = tmp_path_factory.mktemp("eos") / "l3"
    srv = Server(l3, "--max-concurrency", "2", request.param, *SMALL).start()
    yield srv
    assert srv.stop() == 0, srv.output()


def _body(chat: bool, seed: int, **more: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "default", "max_tokens": N, "temperature": 1.0, "seed": seed}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return {**body, **more}


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _ask(url: str, chat: bool, body: dict[str, Any]) -> tuple[str, str, int]:
    """The reply's (text, finish_reason, usage.completion_tokens), streamed when body says so."""
    if not body.get("stream"):
        r = httpx.post(url + _path(chat), json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return text or "", choice["finish_reason"], out["usage"]["completion_tokens"]
    body = {**body, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    finish, tokens = None, None
    with httpx.stream("POST", url + _path(chat), json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for c in event["choices"]:
                parts.append((c["delta"].get("content") if chat else c["text"]) or "")
                finish = c["finish_reason"] or finish
    assert finish is not None and tokens is not None, "the stream had no end or no usage"
    return "".join(parts), finish, tokens


def _early_end(url: str, chat: bool, stream: bool) -> tuple[int, str, int]:
    """A seed whose reply without the flag ends at the end token before N tokens: (the seed,
    its text, its tokens)."""
    for seed in range(40):
        text, finish, tokens = _ask(url, chat, _body(chat, seed, stream=stream))
        if finish == "stop" and tokens < N:
            return seed, text, tokens
    pytest.fail("no seed of 40 ended at the end token early: the flag's effect cannot show")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_ignore_eos_runs_the_reply_to_max_tokens(server: Server, chat: bool, stream: bool) -> None:
    seed, ended, tokens = _early_end(server.url, chat, stream)
    # the byte tokenizer, kept to printable ASCII: a character per token, none for the end
    assert len(ended) == tokens - 1
    text, finish, n = _ask(server.url, chat, _body(chat, seed, stream=stream, ignore_eos=True))
    assert (finish, n) == ("length", N)
    # the same draws up to the end token, which ended nothing and added no text of its own
    assert text.startswith(ended)
    assert len(ended) < len(text) <= N - 1, (ended, text)
    assert "<|end|>" not in text and "\ufffd" not in text, text
    # false is the default: the reply ends at the end token as before
    again = _ask(server.url, chat, _body(chat, seed, stream=stream, ignore_eos=False))
    assert again == (ended, "stop", tokens)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("value", ["true", 1, None, [True]])
def test_a_non_boolean_ignore_eos_is_refused(server: Server, chat: bool, value: Any) -> None:
    r = httpx.post(server.url + _path(chat), json=_body(chat, 0, ignore_eos=value), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "ignore_eos", err
    assert err["message"].startswith("ignore_eos: ") and "boolean" in err["message"], err


def test_ignore_eos_with_a_grammar_is_refused(server: Server) -> None:
    """A grammar ends its reply with the end token once the JSON is whole; past it nothing
    would constrain the reply, so the two are not taken together."""
    body = _body(True, 0, ignore_eos=True, response_format={"type": "json_object"})
    r = httpx.post(server.url + _path(True), json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "ignore_eos" and "response_format" in err["message"], err
