"""Fuzzing the HTTP API of a served process: malformed bodies, headers and request lines each get
a 2xx or a 4xx, never a 5xx, and the server keeps serving."""

from __future__ import annotations

import json
import socket
import string
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from server_proc import Server

SMALL = ("--l1-bytes", "32MiB", "--l2-bytes", "32MiB")
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure reproduces
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
POSTS = ["/v1/chat/completions", "/v1/completions"]
PATHS = [*POSTS, "/healthz", "/readyz", "/v1/models", "/v1/sessions", "/v1/sessions/s-1"]
FIELDS = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "user",
    "presence_penalty",
    "frequency_penalty",
]
HEADERS = ["X-Session-ID", "X-Tenant", "Authorization", "Content-Type", "Accept", "Expect"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    # every accepted request generates at most 8 tokens: the fuzz stays fast
    srv = Server(
        tmp_path_factory.mktemp("srv") / "l3",
        "--max-tokens-limit",
        "8",
        "--body-timeout",
        "2",
        *SMALL,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


@pytest.fixture(scope="module")
def client(server: Server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"])},
        optional={
            "content": st.text(max_size=60)
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text()})),
            "name": st.text(max_size=8),
        },
    ),
    max_size=3,
)
plausible = st.fixed_dictionaries(
    {"model": st.just("default")},
    optional={
        "max_tokens": st.integers(-2, 12),
        "temperature": st.floats(-0.5, 2.5, allow_nan=False),
        "top_p": st.floats(-0.5, 1.5, allow_nan=False),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
        "seed": st.integers(-(2**64), 2**64),
        "user": st.text(max_size=12),
    },
)
valid_roles = st.sampled_from(["system", "user", "assistant"])
plausible_chat = st.builds(
    lambda body, msgs: {**body, "messages": msgs},
    plausible,
    st.lists(
        st.fixed_dictionaries({"role": valid_roles, "content": st.text(max_size=40)}),
        min_size=1,
        max_size=3,
    ),
)
plausible_completion = st.builds(
    lambda body, prompt: {**body, "prompt": prompt}, plausible, st.text(max_size=60)
)
mangled = st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=12),
    json_values,
    max_size=6,
).flatmap(
    lambda extra: st.fixed_dictionaries(
        {"model": st.sampled_from(["default", "other", ""])},
        optional={"messages": messages, "prompt": st.text(max_size=80), "stream": st.booleans()},
    ).map(lambda base: {**base, **extra})
)
bodies = plausible_chat | plausible_completion | mangled


def _ok(status: int) -> bool:
    return 200 <= status < 300 or 400 <= status < 500


@FUZZ
@given(path=st.sampled_from(POSTS), body=bodies)
def test_json_bodies_get_2xx_or_4xx(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    r = client.post(path, json=body)
    event(f"status {r.status_code}")
    assert _ok(r.status_code), (r.status_code, r.text, body)


@FUZZ
@given(
    path=st.sampled_from(POSTS),
    raw=st.binary(max_size=200)
    | st.text(max_size=200)
    | st.integers(900, 20_000).map(lambda n: "[" * n + "]" * n),  # nested past the stack
)
def test_raw_bodies_get_2xx_or_4xx(client: httpx.Client, path: str, raw: bytes | str) -> None:
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert _ok(r.status_code), (r.status_code, r.text, raw)


header_names = st.sampled_from(HEADERS) | st.text(
    alphabet=string.ascii_letters + string.digits + "-_.:@ ", min_size=1, max_size=16
)
header_values = st.text(string.printable.strip(), max_size=40).map(str.encode) | st.binary(
    max_size=40
).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
requests = st.tuples(
    st.sampled_from(["GET", "POST", "DELETE", "PUT", "HEAD", "OPTIONS", "G\x00T", ""]),
    st.sampled_from(PATHS) | st.text(max_size=30).map(lambda t: "/" + t),
    st.lists(st.tuples(header_names, header_values), max_size=5),
    st.binary(max_size=120)
    | st.builds(lambda b: json.dumps(b).encode(), bodies)
    | st.just(b"[" * 5000),
)


def _send_raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):  # Connection: close: until the server closes it
            answer += chunk
    return answer


@FUZZ
@given(request=requests)
def test_raw_requests_get_2xx_or_4xx(
    server: Server, request: tuple[str, str, list[tuple[str, bytes]], bytes]
) -> None:
    method, path, headers, body = request
    head = f"{method} {path} HTTP/1.1\r\nHost: fuzz\r\n".encode("utf-8", "surrogateescape")
    for name, value in headers:
        head += name.encode() + b": " + value + b"\r\n"
    head += b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
    answer = _send_raw(server.port, head + body)
    status_line = answer.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 "), (answer[:300], head)
    status = int(status_line.split()[1])
    event(f"status {status}")
    assert _ok(status), (answer[:300], head)


def test_deeply_nested_json_is_a_400(client: httpx.Client) -> None:
    for deep in (
        "[" * 100_000,
        '{"model": "default", "messages": ' + "[" * 50_000 + "]" * 50_000 + "}",
        '{"model": "default", "prompt": "x", "stop": ' + '{"a":' * 20_000 + "1" + "}" * 20_000,
    ):
        for path in POSTS:
            r = client.post(path, content=deep, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text  # was a 500 RecursionError
            assert "too deeply" in r.json()["error"]["message"]


def test_the_server_still_serves(client: httpx.Client) -> None:
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body["ignore_eos"] = True  # a random model draws its end token at random (1 token once)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
