"""A served process under requests that cost it the most: prompts of megabytes (refused by
their length before they are tokenized, and tokenized off the event loop), clients that leave a
non-streamed request, bodies that stall."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from server_proc import Server

from kvtier.server.devices.model import DEFAULT_SHAPE, byte_tokenizer
from kvtier.server.http.prompting import NORMALIZE_SLACK, max_prompt_chars, token_chars

SMALL = ("--l1-bytes", "32MiB", "--l2-bytes", "32MiB")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = Server(
        tmp_path_factory.mktemp("srv") / "l3",
        "--max-body-bytes",
        "8MiB",
        "--body-timeout",
        "1",
        *SMALL,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


def _healthz_while(url: str, work: Any) -> tuple[list[float], Any]:
    """/healthz's latencies, polled every 10 ms on one connection while `work()` runs."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as c:
            c.get(url + "/healthz")  # the connection is made before the clock starts
            started.set()
            while not done.is_set():
                t = time.perf_counter()
                assert c.get(url + "/healthz").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.01)

    started = threading.Event()
    poller = threading.Thread(target=poll)
    poller.start()
    started.wait(30)
    try:
        result = work()
    finally:
        done.set()
        poller.join()
    return latencies, result


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_megabyte_prompts_are_refused_by_length_and_healthz_stays_fast(
    server: Server, path: str
) -> None:
    text = "lorem ipsum " * (4 * 2**20 // 12)  # 4 MiB: 500 times the built-in model's context
    body: dict[str, Any] = {"model": "default", "max_tokens": 4}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    payload = json.dumps(body).encode()  # encoded once, before the clock starts
    answers: list[tuple[int, float, Any]] = []

    def send() -> None:
        t = time.perf_counter()
        r = httpx.post(
            server.url + path,
            content=payload,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        answers.append((r.status_code, time.perf_counter() - t, r.json()["error"]))

    def four_at_once() -> None:
        senders = [threading.Thread(target=send) for _ in range(4)]
        for s in senders:
            s.start()
        for s in senders:
            s.join()

    latencies, _ = _healthz_while(server.url, four_at_once)
    # before: each prompt was tokenized on the event loop (3.4 s), /healthz waited behind it
    assert max(latencies) < 0.1, sorted(latencies)[-5:]
    assert len(answers) == 4
    for status, seconds, error in answers:
        assert status == 400 and error["code"] == "context_length_exceeded", error
        assert "characters" in error["message"], error  # refused by its length, not counted
        assert seconds < 2.0


def test_a_prompt_under_the_character_bound_is_still_counted(server: Server) -> None:
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": "default", "prompt": "x" * 9000, "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "9000 tokens" in error["message"], error  # tokenized, in a thread


def test_the_character_bound_never_refuses_a_prompt_that_fits() -> None:
    tok = byte_tokenizer()  # the built-in model's
    served = SimpleNamespace(tokenizer=tok, context_tokens=DEFAULT_SHAPE["max_position_embeddings"])
    served.token_chars = -1
    assert token_chars(tok) == len("<|end|>")  # a byte per entry, and the end token
    bound = max_prompt_chars(served)
    assert bound == served.context_tokens * 7 * NORMALIZE_SLACK
    # the text with the most characters per token it has: the end token, over and over
    dense = "<|end|>" * (bound // 7 // NORMALIZE_SLACK)
    assert len(tok.encode(dense, add_special_tokens=False)) <= served.context_tokens
    assert len(dense) <= bound


def _chat_body(max_tokens: int) -> bytes:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "go on for a long time"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return json.dumps(body).encode()


def test_a_non_streamed_request_stops_when_its_client_leaves(server: Server) -> None:
    # 4,000 tokens take ~11 s on 2 CPU cores; the client leaves after 0.5 s
    payload = _chat_body(4000)
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"X-Session-ID: leaver\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        time.sleep(0.5)
    t = time.perf_counter()
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=_chat_body(2),
        headers={"X-Session-ID": "leaver", "Content-Type": "application/json"},
        timeout=60,
    )
    waited = time.perf_counter() - t
    assert r.status_code == 200, r.text
    # before: it waited behind the first turn, which ran on for its whole 4,000 tokens
    assert waited < 2.0, (waited, server.output()[-3000:])


def test_a_stalled_body_gets_408_and_the_connection_closes(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": "default", '
        )
        t = time.perf_counter()
        answer = b""
        while chunk := s.recv(4096):  # until the server closes the connection
            answer += chunk
        assert time.perf_counter() - t < 5.0
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"no part of the request body came" in answer
    assert httpx.get(server.url + "/healthz").status_code == 200


def test_the_server_is_still_whole(server: Server, tmp_path: Path) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", content=_chat_body(3), timeout=60)
    assert r.status_code == 200, r.text
