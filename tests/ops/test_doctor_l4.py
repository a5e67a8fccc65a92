"""`kvtier doctor --l4-url`: maxmemory and maxmemory-policy of a real redis-server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from redis_proc import RedisServer, available

from ops.commands.doctor import command
from ops.doctor_l4 import L4Facts, check_l4, collect_l4, redact

pytestmark = pytest.mark.skipif(
    not available(), reason="redis-server missing: `scripts/bootstrap.sh dev` installs it"
)


def l4_findings(url: str) -> dict[str, tuple[str, str]]:
    return {f.id: (f.severity, f.observed) for f in check_l4(collect_l4(url))}


def test_a_default_redis_grows_without_bound_and_refuses_writes_when_full(
    redis_server: RedisServer,
) -> None:
    found = l4_findings(redis_server.url)
    assert found["l4.reachable"][0] == "ok"
    assert "Redis 7" in found["l4.reachable"][1] or "Redis " in found["l4.reachable"][1]
    assert found["l4.maxmemory"][0] == "warning"
    assert found["l4.maxmemory"][1].startswith("0: no limit (used ")
    assert found["l4.maxmemory_policy"] == ("warning", "noeviction")


def test_a_bounded_evicting_redis_is_healthy(tmp_path: Path) -> None:
    config = ("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    with RedisServer(tmp_path / "r", *config) as redis:
        found = l4_findings(redis.url)
    assert found["l4.maxmemory"][0] == "ok" and found["l4.maxmemory"][1].startswith("64.0 MiB")
    assert found["l4.maxmemory_policy"] == ("ok", "allkeys-lru")


def test_blind_eviction_is_only_noted(tmp_path: Path) -> None:
    config = ("--maxmemory", "1gb", "--maxmemory-policy", "volatile-random")
    with RedisServer(tmp_path / "r", *config) as redis:
        found = l4_findings(redis.url)
    assert found["l4.maxmemory_policy"] == ("info", "volatile-random")


def test_unreachable_redis_is_one_warning(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "r").start()
    redis.stop()
    found = l4_findings(redis.url)
    assert set(found) == {"l4.reachable"}
    assert found["l4.reachable"][0] == "warning"
    assert "ConnectionError" in found["l4.reachable"][1]


def test_config_refused_says_where_to_look(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "r", "--rename-command", "CONFIG", "") as redis:
        found = l4_findings(redis.url)
    assert found["l4.reachable"][0] == "ok"
    for check_id in ("l4.maxmemory", "l4.maxmemory_policy"):
        assert found[check_id][0] == "info"
        assert found[check_id][1].startswith("cannot read it: CONFIG GET refused")


def test_the_password_is_never_shown(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "r", "--requirepass", "s3cret-pw") as redis:
        good = f"redis://:s3cret-pw@127.0.0.1:{redis.port}/0"
        bad = f"redis://:wrong-pw@127.0.0.1:{redis.port}/0"
        ok = list(check_l4(collect_l4(good)))
        refused = list(check_l4(collect_l4(bad)))
    assert {f.id: f.severity for f in ok}["l4.reachable"] == "ok"
    assert [f.severity for f in refused] == ["warning"]
    for f in ok + refused:
        text = json.dumps(f.as_dict())
        assert "s3cret" not in text and "wrong-pw" not in text
        assert ":***@127.0.0.1" in text
    assert redact("redis://u:p@[::1]:6379/2") == "redis://u:***@[::1]:6379/2"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"


def test_unknown_maxmemory_is_info() -> None:
    found = {f.id: f.severity for f in check_l4(L4Facts("redis://h:1/0", version="7.0"))}
    assert found == {"l4.reachable": "ok", "l4.maxmemory": "info", "l4.maxmemory_policy": "info"}


def test_command_checks_l4_from_the_environment(redis_server: RedisServer, tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    l3.mkdir(mode=0o700)
    runner = CliRunner()
    args = ["--json", "--l3-root", str(l3), "--l2-size", "64MiB"]
    result = runner.invoke(command, args, env={"KVTIER_L4_URL": redis_server.url})
    findings = {f["id"]: f for f in json.loads(result.output)["findings"]}
    assert findings["l4.maxmemory_policy"]["severity"] == "warning"
    assert "allkeys-lru" in findings["l4.maxmemory_policy"]["recommended"]
    assert result.exit_code in (1, 2)  # at least the two warnings
    plain = runner.invoke(command, [*args[1:], "--l4-url", redis_server.url])
    assert "WARN  l4.maxmemory " in plain.output and "WARN  l4.maxmemory_policy" in plain.output
    assert "config set maxmemory-policy allkeys-lru" in plain.output
    without = runner.invoke(command, args, env={"KVTIER_L4_URL": ""})
    assert not any(f["id"].startswith("l4.") for f in json.loads(without.output)["findings"])
