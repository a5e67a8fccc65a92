"""`kvtier serve` over real HTTP, as a user drives it: the openai client, curl-like raw bodies."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest
from server_proc import Server

SMALL = ("--l1-bytes", "32MiB", "--l2-bytes", "32MiB")  # start fast; evictions are not tested here
SYSTEM = "You are a careful agent. " * 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = Server(tmp_path_factory.mktemp("srv") / "l3", "--max-concurrency", "4", *SMALL).start()
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, sid: str, text: str, **kw):
    return client.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        temperature=0,
        max_tokens=kw.pop("max_tokens", 12),
        extra_headers={"X-Session-ID": sid, "X-Tenant": kw.pop("tenant", "default")},
        **kw,
    )


def test_health_ready_models(server: Server, client: openai.OpenAI) -> None:
    assert httpx.get(server.url + "/healthz").json()["status"] == "ok"
    assert httpx.get(server.url + "/readyz").json()["status"] == "ready"
    assert [m.id for m in client.models.list()] == ["default"]
    metrics = httpx.get(server.url + "/metrics").text
    assert "kvtier_server_requests_total" in metrics
    # the start-up's full collection (before gc.freeze) was timed
    full = re.search(r'kvtier_server_gc_pause_seconds_count\{generation="2"\} (\S+)', metrics)
    assert full is not None and float(full.group(1)) >= 1, metrics[-2000:]


def test_chat_non_streaming_reports_usage_and_restore_source(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="default",
        messages=[{"role": "user", "content": "hello"}],
        temperature=0,
        max_tokens=8,
        extra_headers={"X-Session-ID": "plain-1"},
    )
    assert raw.headers["x-kvtier-restore-source"] == "recompute"  # a new session
    out = raw.parse()
    assert out.model == "default"
    assert out.choices[0].message.role == "assistant"
    assert out.usage is not None and out.usage.completion_tokens == 8
    assert out.choices[0].finish_reason == "length"
    assert len(out.choices[0].message.content or "") == 8  # printable ASCII, one byte each


def test_stream_equals_non_stream_greedy(client: openai.OpenAI) -> None:
    full = chat(client, "greedy-a", "compare me").choices[0].message.content
    stream = chat(client, "greedy-b", "compare me", stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == full
    text = client.completions.create(
        model="default", prompt="abc", max_tokens=5, temperature=0, stream=True
    )
    assert len("".join(c.choices[0].text for c in text)) == 5


def test_session_id_from_user_field_and_second_turn_restores(
    server: Server, client: openai.OpenAI
) -> None:
    # A tenant of its own: other tests' sessions share the system prompt's chunks per tenant.
    first = chat(client, "", "turn one", user="via-user-field", tenant="solo")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.with_raw_response.create(
        model="default",
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "turn one"},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "turn two"},
        ],
        temperature=0,
        max_tokens=4,
        user="via-user-field",
        extra_headers={"X-Tenant": "solo"},
    )
    assert again.headers["x-kvtier-restore-source"] in ("l1", "l2", "l3")
    usage = again.parse().usage
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


@pytest.mark.parametrize("flags", [("--no-paged-l1",), ("--no-paged-l1", "--park-pages")])
def test_sessions_in_l1_buffers_serve_the_same_replies(
    server: Server,
    client: openai.OpenAI,
    tmp_path_factory: pytest.TempPathFactory,
    flags: tuple[str, ...],
) -> None:
    """A server whose sessions live in L1 buffers between turns (--no-paged-l1), with parked
    pages or without, answers a three-turn conversation exactly as the module's server (the
    pool as the sessions' L1), and every returning turn of both starts from parked pages."""
    park = Server(
        tmp_path_factory.mktemp("park") / "l3", "--max-concurrency", "4", *SMALL, *flags
    ).start()
    try:
        parked = openai.OpenAI(base_url=park.url + "/v1", api_key="unused", max_retries=0)
        replies: list[list[str]] = []
        for c in (client, parked):
            messages = [{"role": "system", "content": SYSTEM}]
            said: list[str] = []
            for text in ("plan the task", "run step one", "report"):
                messages.append({"role": "user", "content": text})
                out = c.chat.completions.create(
                    model="default",
                    messages=messages,  # type: ignore[arg-type]
                    temperature=0,
                    max_tokens=10,
                    extra_headers={"X-Session-ID": "park-conv", "X-Tenant": "park"},
                )
                said.append(out.choices[0].message.content or "")
                messages.append({"role": "assistant", "content": said[-1]})
            replies.append(said)
        assert replies[0] == replies[1]
        for url, parks in ((server.url, True), (park.url, "--park-pages" in flags)):
            text = httpx.get(url + "/metrics", timeout=10).text
            found = re.search(r"^kvtier_server_parked_turns_total ([0-9.]+)$", text, re.M)
            assert found and (float(found.group(1)) >= 2) == parks, text[-2000:]
    finally:
        assert park.stop() == 0, park.output()


def test_unknown_model_is_openai_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    assert err.value.body["code"] == "model_not_found"


BAD = {
    "malformed JSON": (b'{"model": "default", "messages": [', {}),
    "invalid UTF-8": (b'{"model":"default","messages":[{"role":"user","content":"\xff\xfe"}]}', {}),
    "unknown field": (
        b'{"model":"default","messages":[{"role":"user","content":"x"}],"temp":1}',
        {},
    ),
    "huge max_tokens": (
        b'{"model":"default","messages":[{"role":"user","content":"x"}],'
        b'"max_tokens":100000000000000000000000}',
        {},
    ),
    "prompt longer than the context": (
        b'{"model":"default","messages":[{"role":"user","content":"' + b"y" * 9000 + b'"}]}',
        {},
    ),
    "10 KB session id": (
        b'{"model":"default","messages":[{"role":"user","content":"x"}]}',
        {"X-Session-ID": "s" * 10240},
    ),
    "not an object": (b"[1, 2]", {}),
    "wrong type": (b'{"model":"default","messages":"hello"}', {}),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_openai_4xx_and_server_keeps_serving(
    server: Server, client: openai.OpenAI, case: str
) -> None:
    body, headers = BAD[case]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=body,
        headers={"Content-Type": "application/json", **headers},
    )
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and len(error["message"]) > 10
    assert chat(client, "after-bad", "still there?", max_tokens=2).choices[0].message.content


def test_error_messages_say_what_to_do(server: Server) -> None:
    url = server.url + "/v1/chat/completions"
    r = httpx.post(url, content=BAD["unknown field"][0])
    assert "unknown field 'temp'" in r.json()["error"]["message"]
    assert "temperature" in r.json()["error"]["message"]  # lists what is accepted
    r = httpx.post(url, content=BAD["prompt longer than the context"][0])
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url, content=BAD["huge max_tokens"][0])
    assert "at most" in r.json()["error"]["message"]


def test_idle_keep_alive_outlives_the_clients(server: Server) -> None:
    # httpx drops a pooled connection after 5 s idle; the server must keep it longer, or a
    # request sent as the server closes it fails (a race seen under load)
    with httpx.Client(limits=httpx.Limits(keepalive_expiry=30)) as c:
        first = c.get(server.url + "/healthz", extensions={"trace": _trace(seen := [])})
        time.sleep(6)  # past uvicorn's default of 5 s
        second = c.get(server.url + "/healthz", extensions={"trace": _trace(seen)})
    assert first.status_code == second.status_code == 200
    assert seen.count("connection.connect_tcp.complete") == 1  # the second reused the first


def _trace(events: list[str]):
    def trace(name: str, info: dict) -> None:
        events.append(name)

    return trace


def _batch_steps(url: str) -> tuple[float, float]:
    """(steps, steps of one sequence) so far, from the batch-size histogram on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    steps = single = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name != "kvtier_server_batch_size":
            continue
        for sample in family.samples:
            if sample.name.endswith("_count"):
                steps = sample.value
            elif sample.name.endswith("_bucket") and float(sample.labels["le"]) == 1.0:
                single = sample.value
    return steps, single


def test_one_session_served_in_order(server: Server, client: openai.OpenAI) -> None:
    """Three requests of one session at once queue behind each other: none is refused, and no
    step of the batch ever held two of them (every step of the window had one sequence). A
    count on the server's own histogram, so a loaded machine cannot make it flaky."""
    results: list[tuple[float, float]] = []

    def one() -> None:
        t = time.perf_counter()
        chat(client, "ordered", "same session", max_tokens=30)
        results.append((t, time.perf_counter()))

    steps0, single0 = _batch_steps(server.url)
    threads = [threading.Thread(target=one) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    steps, single = _batch_steps(server.url)
    assert len(results) == 3  # none refused: they queued behind each other
    # one after another, each reply its own steps (together they would share about 32)
    assert steps - steps0 >= 3 * 20, (steps0, steps)
    assert single - single0 == steps - steps0, (single0, single, steps0, steps)


def test_admin_sessions_hibernate_prefetch_delete(server: Server, client: openai.OpenAI) -> None:
    chat(client, "admin-1", "hello admin")
    listing = httpx.get(server.url + "/v1/sessions").json()["data"]
    mine = next(s for s in listing if s["session_id"] == "admin-1")
    assert mine["tokens"] > 0
    r = httpx.post(server.url + "/v1/sessions/admin-1/hibernate")
    assert r.status_code == 200
    states = {s["session_id"]: s for s in httpx.get(server.url + "/v1/sessions").json()["data"]}
    assert states["admin-1"]["state"] == "hibernated" and states["admin-1"]["chunks_l1"] == 0
    assert httpx.post(server.url + "/v1/sessions/admin-1/prefetch").status_code == 200
    assert httpx.delete(server.url + "/v1/sessions/admin-1").json()["deleted"] is True
    ids = {s["session_id"] for s in httpx.get(server.url + "/v1/sessions").json()["data"]}
    assert "admin-1" not in ids
    r = httpx.post(server.url + "/v1/sessions/admin-1/hibernate")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_admin_hibernate_frees_the_parked_pages(client: openai.OpenAI, server: Server) -> None:
    """With the pool as the sessions' L1, a returning turn starts from its parked pages (L1);
    after an admin's hibernate they are gone and the next turn restores from L2."""
    messages = [{"role": "system", "content": SYSTEM}]
    sources = []
    for text in ("one", "two", "three"):
        messages.append({"role": "user", "content": text})
        raw = client.chat.completions.with_raw_response.create(
            model="default",
            messages=messages,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=6,
            extra_headers={"X-Session-ID": "hib-pages", "X-Tenant": "hib"},
        )
        sources.append(raw.headers["x-kvtier-restore-source"])
        messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
        if text == "two":
            parked = _parked_pages(server.url)
            r = httpx.post(server.url + "/v1/sessions/hib-pages/hibernate?tenant=hib")
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 10  # the scheduler frees them between its steps
            while _parked_pages(server.url) >= parked and time.monotonic() < deadline:
                time.sleep(0.05)
            assert 0 <= _parked_pages(server.url) < parked
    assert sources == ["recompute", "l1", "l2"]


def _parked_pages(url: str) -> float:
    """`kvtier_server_kv_pages{state="parked"}` of a server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(r'^kvtier_server_kv_pages\{state="parked"\} ([0-9.e+]+)$', text, re.M)
    assert found, text[-2000:]
    return float(found.group(1))


def test_disconnect_mid_stream_frees_l1_keeps_committed(server: Server) -> None:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "go on " * 50}],
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "gone"}
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(12)]
        assert any('"content"' in line for line in got)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = {s["session_id"]: s for s in httpx.get(server.url + "/v1/sessions").json()["data"]}
        if info.get("gone", {}).get("state") == "hibernated":
            break
        time.sleep(0.1)
    gone = info["gone"]
    assert gone["state"] == "hibernated" and gone["chunks_l1"] == 0  # L1 freed
    assert 300 < gone["tokens"] < 300 + 2000  # prompt + what was generated before the cut
