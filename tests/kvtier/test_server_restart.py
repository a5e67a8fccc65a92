"""Session continuity across restarts, SIGTERM drain, and `--model PATH` (live servers)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai
import pytest
from server_proc import Server

SMALL = ("--l1-bytes", "32MiB", "--l2-bytes", "32MiB")
SYSTEM = "Tools: search(query), fetch(url), write(path, text). Be brief. " * 12


def _client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _turn(srv: Server, messages: list[dict[str, str]], sid: str | None) -> tuple[str, str]:
    headers = {"X-Session-ID": sid} if sid else {}
    raw = _client(srv).chat.completions.with_raw_response.create(
        model="default", messages=messages, temperature=0, max_tokens=24, extra_headers=headers
    )
    return raw.parse().choices[0].message.content or "", raw.headers["x-kvtier-restore-source"]


def test_restart_resumes_sessions_with_identical_greedy_output(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    user_turns = ["open ticket 42", "customer says the printer is on fire", "close it"]
    reference = Server(tmp_path / "none", "--cache", "none").start()
    tiered = Server(l3, *SMALL).start()
    try:
        convo = [{"role": "system", "content": SYSTEM}]
        expected: list[str] = []
        for text in user_turns:  # the reference: recompute every prompt, no cache at all
            convo.append({"role": "user", "content": text})
            reply, source = _turn(reference, convo, None)
            assert source == "recompute"
            expected.append(reply)
            convo.append({"role": "assistant", "content": reply})

        convo = [{"role": "system", "content": SYSTEM}]
        for i, text in enumerate(user_turns[:2]):
            convo.append({"role": "user", "content": text})
            reply, source = _turn(tiered, convo, "ticket-42")
            assert reply == expected[i]
            assert source == ("recompute" if i == 0 else "l1")
            convo.append({"role": "assistant", "content": reply})
        assert tiered.stop() == 0, tiered.output()  # drain: hibernate everything to L3

        tiered = Server(l3, *SMALL).start()  # a new process: L1 and L2 are empty
        listed = httpx.get(tiered.url + "/v1/sessions").json()["data"]
        mine = next(s for s in listed if s["session_id"] == "ticket-42")
        assert mine["state"] == "hibernated" and mine["tokens"] > len(SYSTEM)
        convo.append({"role": "user", "content": user_turns[2]})
        reply, source = _turn(tiered, convo, "ticket-42")
        assert source == "l3"
        assert reply == expected[2]
        usage_check = httpx.post(
            tiered.url + "/v1/chat/completions",
            json={"model": "default", "messages": convo, "max_tokens": 1, "temperature": 0},
            headers={"X-Session-ID": "ticket-42"},
        ).json()["usage"]
        assert usage_check["prompt_tokens_details"]["cached_tokens"] > len(SYSTEM)
    finally:
        reference.kill()
        tiered.kill()


def test_sigterm_finishes_in_flight_then_hibernates_and_exits_0(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    srv = Server(l3, *SMALL).start()
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "write a long answer"}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    chunks: list[str] = []
    first = threading.Event()

    def stream() -> None:
        with httpx.stream(
            "POST", srv.url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "drain"}
        ) as r:
            for line in r.iter_lines():
                if line:
                    chunks.append(line)
                    first.set()

    th = threading.Thread(target=stream)
    th.start()
    try:
        assert first.wait(30)
        assert srv.stop() == 0, srv.output()  # SIGTERM while the stream is running
        th.join(30)
        assert chunks[-1] == "data: [DONE]"  # the in-flight request was finished, not cut
        assert '"finish_reason":"length"' in "".join(chunks)
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/healthz")  # not accepting any more

        again = Server(l3, *SMALL).start()
        try:
            listed = httpx.get(again.url + "/v1/sessions").json()["data"]
            drained = next(s for s in listed if s["session_id"] == "drain")
            assert drained["state"] == "hibernated" and drained["tokens"] >= 400
        finally:
            assert again.stop() == 0
    finally:
        srv.kill()
        th.join(5)


def test_model_path_loads_a_saved_directory(tmp_path: Path) -> None:
    from kvtier.server.devices.model import build_default

    served = build_default("cpu", seed=3)
    model_dir = tmp_path / "tiny-llama"
    served.model.save_pretrained(model_dir)
    served.tokenizer.save_pretrained(model_dir)
    by_path = Server(tmp_path / "a", "--cache", "none", "--model", str(model_dir))
    by_seed = Server(tmp_path / "b", "--cache", "none", "--seed", "3")
    try:
        by_path.start()
        by_seed.start()
        convo = [{"role": "user", "content": "same weights, same words"}]
        assert _turn(by_path, convo, None)[0] == _turn(by_seed, convo, None)[0]
    finally:
        by_path.kill()
        by_seed.kill()


def test_bad_model_path_is_a_clear_error(tmp_path: Path) -> None:
    srv = Server(tmp_path / "l3", "--model", str(tmp_path))
    with pytest.raises(RuntimeError):
        srv.start(timeout=30)
    srv.kill()
    assert "no config.json" in srv.output() or "config.json" in srv.output()
