"""One vocabulary across the commands: the same setting has the same flag in every command
(`--l3-root`, `--l3-cold-root`, `--l2-bytes`, `--host`/`--port`), the old spellings still work
as hidden aliases, and a bad option exits 2 (click's usage error) in every command."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ops.cli import LazyCommand, cli
from ops.kvtop.app import main as kvtop

REPO = Path(__file__).resolve().parents[2]


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, cmd in sorted(group.commands.items()):
        real = cmd.load() if isinstance(cmd, LazyCommand) else cmd
        if isinstance(real, click.Group):
            yield from _commands(real, (*path, name))
        else:
            yield (*path, name)


def _command(path: tuple[str, ...]) -> click.Command:
    cmd: click.Command = cli
    for name in path:
        assert isinstance(cmd, click.Group)
        cmd = cmd.commands[name]
        if isinstance(cmd, LazyCommand):
            cmd = cmd.load()
    return cmd


EVERY = sorted(_commands(cli))


def _flags(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params for o in p.opts}


def _help(args: list[str], command: click.Command = cli) -> str:
    out = CliRunner().invoke(command, [*args, "--help"])
    assert out.exit_code == 0, out.output
    return out.output


def test_every_command_is_walked() -> None:
    assert {p[0] for p in EVERY} >= {"doctor", "exporter", "keys", "l3", "loadgen", "plan", "serve"}
    assert ("l3", "fsck") in EVERY and ("l3", "stat") in EVERY


@pytest.mark.parametrize("path", EVERY, ids=" ".join)
def test_a_bad_option_exits_2_everywhere(path: tuple[str, ...]) -> None:
    out = CliRunner().invoke(cli, [*path, "--no-such-option"])
    assert out.exit_code == 2, out.output
    assert "No such option '--no-such-option'" in out.output


def test_a_bad_option_exits_2_in_kvtop() -> None:
    out = CliRunner().invoke(kvtop, ["--no-such-option"])
    assert out.exit_code == 2, out.output


def test_the_l3_store_is_l3_root_in_every_command() -> None:
    naming = [p for p in EVERY if {"--l3-root", "--root"} & _flags(_command(p))]
    assert {("serve",), ("doctor",), ("exporter",), ("l3", "fsck"), ("l3", "stat")} <= set(naming)
    for path in naming:
        text = _help(list(path))
        assert "--l3-root" in text, path
        assert "--root " not in text and "--root," not in text, path  # the alias is hidden
    assert "--l3-root" in _help([], kvtop)


@pytest.mark.parametrize("sub", ["ls", "stat", "fsck", "migrate", "gc", "shred"])
def test_l3_commands_take_root_as_a_hidden_alias(sub: str) -> None:
    flags = _flags(_command(("l3", sub)))
    assert {"--l3-root", "--root"} <= flags


def test_l3_root_and_its_alias_open_the_same_store(tmp_path: Path) -> None:
    from kvtier.tiers.l3 import L3Store

    (tmp_path / "l3").mkdir(mode=0o700)
    L3Store(tmp_path / "l3").close()  # an empty store
    for flag in ("--l3-root", "--root"):
        out = CliRunner().invoke(cli, ["l3", "stat", flag, str(tmp_path / "l3"), "--json"])
        assert out.exit_code == 0, out.output
        assert str(tmp_path / "l3") in out.output
    missing = CliRunner().invoke(cli, ["l3", "stat"])
    assert missing.exit_code == 2 and "Missing option '--l3-root'." in missing.output


def test_cold_root_and_l2_bytes_have_the_servers_names() -> None:
    assert "--l3-cold-root" in _flags(_command(("serve",)))
    for sub in ("fsck", "migrate", "gc"):
        text = _help(["l3", sub])
        assert "--l3-cold-root" in text and "--cold-dir" not in text
        assert "--cold-dir" in _flags(_command(("l3", sub)))  # the old spelling still works
    assert "--l2-bytes" in _flags(_command(("serve",)))
    text = _help(["doctor"])
    assert "--l2-bytes" in text and "--l2-size" not in text
    assert "--l2-size" in _flags(_command(("doctor",)))


def test_doctor_reads_l2_bytes_and_its_alias(tmp_path: Path) -> None:
    for flag in ("--l2-bytes", "--l2-size"):
        out = CliRunner().invoke(cli, ["doctor", flag, "lots", "--l3-root", str(tmp_path)])
        assert out.exit_code == 2
        assert "Invalid value for '--l2-bytes': cannot read size 'lots'" in out.output


def test_exporter_and_serve_both_take_host_and_port() -> None:
    for name in ("serve", "exporter"):
        assert {"--host", "--port"} <= _flags(_command((name,))), name


def test_exporter_listens_on_port(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    root.mkdir(mode=0o700)
    cmd = [sys.executable, "-m", "ops.cli", "exporter", "--l3-root", str(root), "--no-gpu"]
    proc = subprocess.Popen([*cmd, "--port", "0"], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # kvtier exporter: http://127.0.0.1:PORT/metrics ...
        assert line.startswith("kvtier exporter: http://127.0.0.1:"), line
        url = line.split()[2]
        assert int(url.rsplit(":", 1)[1].split("/")[0]) != 9481
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "kvtier_l3_up" in body
    finally:
        proc.terminate()
        proc.communicate(timeout=20)
    bad = CliRunner().invoke(cli, ["exporter", "--l3-root", str(root), "--port", "70000"])
    assert bad.exit_code == 2 and "--port" in bad.output


def test_plan_speaks_serves_words() -> None:
    """plan's inputs are serve's flags (--model, --l2-bytes, --l3-max-bytes); the old spellings
    still work, hidden; --codec and --write-policy list their choices."""
    text = _help(["plan"])
    for flag in ("--model ", "--l2-bytes", "--l3-max-bytes", "--gpu-memory-utilization"):
        assert flag in text, flag
    for old in ("--model-config", "--host-mem", "--ssd"):
        assert old not in text and old in _flags(_command(("plan",))), old
    serve = _help(["serve"])
    assert "[native|int8|fp8]" in serve
    assert "[write_through|write_through_selective|write_back]" in serve


@pytest.mark.parametrize("path", EVERY, ids=" ".join)
def test_every_option_has_help(path: tuple[str, ...]) -> None:
    cmd = _command(path)
    bare = [p.opts[0] for p in cmd.params if isinstance(p, click.Option) and not p.help]
    assert not bare, f"kvtier {' '.join(path)}: options without help: {bare}"


def test_every_serve_option_states_its_default() -> None:
    """`kvtier serve --help` is where a new user reads what happens when a flag is left out."""
    silent = [p.opts[0] for p in _command(("serve",)).params if "default" not in (p.help or "")]
    assert not silent, f"serve options whose help gives no default: {silent}"
