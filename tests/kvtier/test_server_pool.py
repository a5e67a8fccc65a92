"""`--cache pool` (GPU-only prefix caching) and `--cache none` over real HTTP: the two baselines
of a trace's bench (docs/benchmarks.md, "A real trace"). With the pool alone a returning turn
starts from its session's parked pages, exactly as a recompute would answer; once other sessions
took its pages it recomputes; and nothing is ever written below the pool. With no cache every
turn recomputes."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from server_proc import Server

from kvtier.errors import ConfigError
from kvtier.server.config import ServerConfig

# 4,096 tokens of the built-in model's K/V (512 bytes a token): room for two of the sessions below
POOL = ("--batch-kv-bytes", "2MiB", "--max-concurrency", "2")


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 3 for i in range(n)]


def _complete(url: str, sid: str, ids: list[int], max_tokens: int = 8) -> tuple[str, str, int]:
    """(the reply, its restore source, the usage's cached tokens) of a greedy completion."""
    body = {"model": "default", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    r = httpx.post(
        url + "/v1/completions",
        json=body,
        headers={"X-Session-ID": sid, "X-Tenant": "pool"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    return out["choices"][0]["text"], r.headers["x-kvtier-restore-source"], cached


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_pool_alone_resumes_from_parked_pages_recomputes_once_they_went_and_writes_nothing(
    tmp_path: Path,
) -> None:
    first = _ids(1, 600)
    second = first + _ids(2, 100)
    others = {f"o{i}": _ids(10 + i, 1500) for i in range(3)}
    third = second + _ids(3, 50)
    for name in ("pool", "none"):
        (tmp_path / name).mkdir()
    pool = Server(tmp_path / "pool" / "l3", "--cache", "pool", *POOL).start()
    try:
        one = _complete(pool.url, "a", first)
        two = _complete(pool.url, "a", second)
        for sid, ids in others.items():  # each parks 1,500 tokens: a's pages go first (LRU)
            _complete(pool.url, sid, ids)
        three = _complete(pool.url, "a", third)
        metrics = httpx.get(pool.url + "/metrics", timeout=10).text
    finally:
        assert pool.stop() == 0, pool.output()
    assert one[1:] == ("recompute", 0)
    assert two[1:] == ("l1", 600)  # the first turn's prompt, from its parked pages
    assert three[1:] == ("recompute", 0)  # its pages went to the other sessions
    assert re.search(r"^kvtier_server_parked_turns_total 1\.0$", metrics, re.M), metrics[-3000:]
    assert _files(tmp_path / "pool" / "l3") == []  # nothing stored: not a file

    none = Server(tmp_path / "none" / "l3", "--cache", "none", *POOL).start()
    try:
        ref = [_complete(none.url, "a", ids) for ids in (first, second, third)]
    finally:
        assert none.stop() == 0, none.output()
    assert [r[1:] for r in ref] == [("recompute", 0)] * 3  # no cache: a true recompute
    assert [one[0], two[0], three[0]] == [r[0] for r in ref]  # the parked pages are exact


def test_pool_admin_hibernate_frees_the_pages_and_the_next_turn_recomputes(tmp_path: Path) -> None:
    first = _ids(4, 300)
    srv = Server(tmp_path / "l3", "--cache", "pool", *POOL).start()
    try:
        _complete(srv.url, "h", first)
        assert _complete(srv.url, "h", first + _ids(5, 40))[1:] == ("l1", 300)
        r = httpx.post(srv.url + "/v1/sessions/h/hibernate?tenant=pool", timeout=30)
        assert r.status_code == 200, r.text
        assert _complete(srv.url, "h", first + _ids(5, 80))[1:] == ("recompute", 0)
        r = httpx.post(srv.url + "/v1/sessions/unknown/prefetch", timeout=30)
        assert r.status_code == 404  # a session the pool holds nothing of
    finally:
        assert srv.stop() == 0, srv.output()


@pytest.mark.parametrize(
    "off",
    [{"batching": False}, {"paged_l1": False}, {"codec": "int8"}, {"devices": "auto"}],
)
def test_pool_needs_the_batch_and_its_pages(off: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="'pool' keeps K/V in the batch's page pool"):
        ServerConfig(cache="pool", **off)  # type: ignore[arg-type]
    ServerConfig(cache="pool")
