"""`kvtier serve --max-sessions N --session-ttl-s T` (a live server): idle sessions past either
bound leave memory (the cache's table, the listing, their parked pages) and their next turn
finds them in L3 with their cached tokens."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
from server_proc import Server, chat

MAX, TTL_S = 4, 4.0


def _parked_pages(srv: Server) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    m = re.search(r'^kvtier_server_kv_pages\{state="parked"\} (\S+)$', text, re.M)
    assert m is not None, "no parked-pages gauge"
    return float(m.group(1))


def _listed(srv: Server) -> list[str]:
    data = httpx.get(srv.url + "/v1/sessions", timeout=10).json()["data"]
    return [s["session_id"] for s in data]


def _wait(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_idle_sessions_leave_memory_and_come_back_from_l3(tmp_path: Path) -> None:
    srv = Server(tmp_path / "l3", "--max-sessions", str(MAX), "--session-ttl-s", str(TTL_S)).start()
    try:
        first, one = {}, 0.0
        for i in range(3 * MAX):  # distinct sessions: a parked table each
            msg = [{"role": "user", "content": f"{i:02d} " + "plan the next step. " * 12}]
            first[i] = (msg, chat(srv.url, f"s{i}", msg, max_tokens=4).json())
            assert len(_listed(srv)) <= MAX
            if i == 0:  # the pages one session keeps
                _wait(lambda: _parked_pages(srv) > 0)
                one = _parked_pages(srv)
            # no more than MAX sessions' pages: a forgotten session's went (before its TTL)
            _wait(lambda one=one: _parked_pages(srv) <= MAX * one, timeout=TTL_S / 2)
        # idle past the TTL: none is left in memory, nor in the pool
        _wait(lambda: _listed(srv) == [] and _parked_pages(srv) == 0)
        # the first session's next turn restores from L3 (or L2) what its first turn stored
        msg, out = first[0]
        convo = [*msg, out["choices"][0]["message"], {"role": "user", "content": "go on"}]
        r = chat(srv.url, "s0", convo, max_tokens=4)
        assert r.headers["x-kvtier-restore-source"] in ("l2", "l3")
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= out["usage"]["prompt_tokens"]
        # an admin's forget finds a forgotten session in L3
        assert httpx.delete(srv.url + "/v1/sessions/s1", timeout=10).status_code == 200
        assert httpx.delete(srv.url + "/v1/sessions/s1", timeout=10).status_code == 404
    finally:
        srv.kill()
