"""The commands and defaults the docs name are the ones the code and the Ansible role have."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kvtier.cli.l3 import command as l3

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md", *ROOT.glob("*/README.md")])


def test_every_kvtier_l3_subcommand_named_in_the_docs_exists() -> None:
    named = {
        (doc.name, m.group(1))
        for doc in DOCS
        if doc.exists()
        for m in re.finditer(r"kvtier l3 ([a-z][a-z-]*)", doc.read_text())
    }
    assert named, "no doc names a kvtier l3 command"
    wrong = sorted((doc, sub) for doc, sub in named if sub not in l3.commands)
    assert not wrong, f"docs name kvtier l3 subcommands that do not exist: {wrong}"


def test_host_tuning_names_the_roles_fstrim_default() -> None:
    defaults = ROOT / "ansible" / "roles" / "kvtier_host" / "defaults" / "main.yml"
    default = yaml.safe_load(defaults.read_text())["kvtier_host_fstrim"]
    row = next(
        line for line in (ROOT / "docs" / "host-tuning.md").read_text().splitlines()
        if line.startswith("| fstrim |")
    )  # fmt: skip
    assert f"(`{default}`, the role's default)" in row, row


def test_kvtier_plan_is_documented_outside_the_runbook() -> None:
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    assert "kvtier plan --model configs/models/" in quickstart
    assert (ROOT / "configs" / "models" / "qwen2-7b" / "config.json").is_file()


def test_the_switches_list_names_every_switch() -> None:
    """configuration.md's list of the settings that take true/false is every boolean one."""
    import dataclasses
    import re

    from kvtier.server.config import ServerConfig

    text = (ROOT / "docs" / "configuration.md").read_text()
    listed = text.split("Switches (", 1)[1].split(") accept", 1)[0]
    names = set(re.findall(r"`([a-z0-9_]+)`", listed))
    switches = {f.name for f in dataclasses.fields(ServerConfig) if isinstance(f.default, bool)}
    assert names == switches, (sorted(switches - names), sorted(names - switches))
    assert "`make demo` with 32 slots" not in text  # the demo runs --max-concurrency 8


def test_benchmarks_page_holds_current_figures_only() -> None:
    """docs/benchmarks.md stays readable (at most 800 lines); earlier runs go to the history."""
    lines = (ROOT / "docs" / "benchmarks.md").read_text().count("\n")
    assert lines <= 800, f"docs/benchmarks.md is {lines} lines: move runs to benchmarks-history.md"
