"""Alert and recording rules: generated from ops.thresholds, valid for promtool, each alert
tested firing and quiet, each linked to its own runbook section; the dashboard is generated."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ops import thresholds
from ops.exporter import rule_tests, rules

REPO = Path(__file__).resolve().parents[2]
PROM = REPO / "dashboards" / "prometheus"
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool missing: `scripts/bootstrap.sh dev` installs Debian's prometheus package",
)


def alerts() -> list[dict]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_rule_files_are_generated_from_thresholds() -> None:
    assert (PROM / "alerts.yml").read_text() == rules.render_alerts(), (
        "alerts.yml is stale: run python -m ops.exporter.rules dashboards/prometheus"
    )
    assert (PROM / "recording.yml").read_text() == rules.render_recording()
    assert (PROM / "tests" / "alerts_test.yml").read_text() == rule_tests.render(), (
        "alerts_test.yml is stale: run python -m ops.exporter.rule_tests"
    )


def test_every_threshold_number_is_in_its_rule() -> None:
    by_name = {a["alert"]: a for a in alerts()}
    assert set(by_name) == set(thresholds.BY_ALERT)
    for t in thresholds.ALL:
        expr = by_name[t.alert]["expr"]
        assert re.search(rf"(?<![\w.]){re.escape(rules.number(t.value))}(?![\w.])", expr), t.alert
        assert by_name[t.alert]["labels"]["severity"] == t.severity


def test_required_alerts_exist() -> None:
    exprs = " ".join(a["expr"] for a in alerts())
    for needle in (
        "kvtier_pressure_memory_stalled_seconds_total",  # PSI full
        "predict_linear(kvtier_memory_available_bytes",  # available memory, hugetlb excluded
        "kvtier_vmstat_allocstall_total",  # direct reclaim
        'order=~"9|',  # high-order blocks
        "kvtier_hugepages_free",  # hugepage pool
        "kvtier:gpu_memory_free:ratio",  # GPU headroom
        'kvtier_tier_evictions_total{tier="l1"}',  # L1 storm
        'kvtier:tier_utilization:ratio{tier="l2"}',  # L2 slots
        "predict_linear(kvtier_l3_filesystem_avail_bytes",  # L3 filling
        "kvtier_shed_writes_total",
        "kvtier_checksum_failures_total",
        "kvtier_memory_dirty_threshold_bytes",
        "kvtier_gpu_pcie_link_max_width",
        "kvtier_vmstat_oom_kill_total",
        "kvtier_torch_alloc_retries_total",  # allocator retries: the first OOM pitfall
        "kvtier_torch_inactive_split_bytes / (kvtier_torch_reserved_bytes > 0)",  # fragmentation
        "kvtier_gpu_memory_process_bytes\n/ (kvtier_gpu_memory_budget_bytes > 0)",
        "kvtier_l4_breaker_state >= 2",  # the shared L4 tier down
        "kvtier_l4_up == 0",
        "rate(kvtier_l4_errors_total",
        "kvtier_l4_shard_replicas < 1",  # a cluster shard without a replica
        "rate(kvtier_moved_sessions_total",  # moves that go on: a host flapping
    ):
        assert needle in exprs, needle
    rec = (PROM / "recording.yml").read_text()
    assert "kvtier_memory_total_bytes - kvtier_memory_hugetlb_bytes" in rec


def test_every_alert_links_its_own_runbook_section() -> None:
    runbook = (REPO / "docs" / "runbook.md").read_text()
    headings = re.findall(r"^## (\S+)$", runbook, re.M)
    assert "`runbook`" not in runbook, "the annotation is called runbook_url"
    for a in alerts():
        name = a["alert"]
        # `runbook_url`, the key the monitoring mixins use (Alertmanager templates look for it)
        assert a["annotations"]["runbook_url"] == f"docs/runbook.md#{name.lower()}"
        assert "runbook" not in a["annotations"], name
        assert headings.count(name) == 1, f"docs/runbook.md needs one '## {name}' section"
        section = runbook.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("**Means.**", "**Check.**", "**Do.**"):
            assert part in section, f"{name}: runbook section lacks {part}"
    assert set(headings) == {a["alert"] for a in alerts()}, "runbook sections without an alert"


def test_one_firing_and_one_quiet_case_per_alert() -> None:
    doc = yaml.safe_load((PROM / "tests" / "alerts_test.yml").read_text())
    firing: dict[str, int] = {}
    quiet: dict[str, int] = {}
    for test in doc["tests"]:
        for case in test["alert_rule_test"]:
            target = firing if case["exp_alerts"] else quiet
            target[case["alertname"]] = target.get(case["alertname"], 0) + 1
    names = {a["alert"] for a in alerts()}
    assert set(firing) == names, names - set(firing)
    assert set(quiet) == names, names - set(quiet)


@needs_promtool
def test_promtool_check_rules() -> None:
    out = subprocess.run(
        ["promtool", "check", "rules", str(PROM / "alerts.yml"), str(PROM / "recording.yml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_test_rules() -> None:
    tests = sorted(str(p) for p in (PROM / "tests").glob("*.yml"))
    out = subprocess.run(
        ["promtool", "test", "rules", *tests], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_catches_a_broken_threshold(tmp_path: Path) -> None:
    """The promtool cases can fail: with the PSI threshold raised above the firing case's
    10%, its firing case must fail."""
    (tmp_path / "tests").mkdir()
    text = rules.render_alerts().replace(
        "stalled_seconds_total[5m]) > 0.05", "stalled_seconds_total[5m]) > 0.5"
    )
    assert text != rules.render_alerts()
    (tmp_path / "alerts.yml").write_text(text)
    (tmp_path / "recording.yml").write_text(rules.render_recording())
    (tmp_path / "tests" / "t.yml").write_text(rule_tests.render())
    out = subprocess.run(
        ["promtool", "test", "rules", str(tmp_path / "tests" / "t.yml")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "KvtierMemoryPressureFullStall firing" in out.stdout + out.stderr


def test_dashboard_is_generated_and_well_formed() -> None:
    path = REPO / "dashboards" / "grafana" / "kvtier.json"
    out = subprocess.run(
        [sys.executable, str(REPO / "dashboards" / "grafana" / "generate.py"), "-"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    sys.path.insert(0, str(path.parent))
    try:
        import generate  # the generator script, standard library only
    finally:
        sys.path.pop(0)
    assert path.read_text() == generate.render(), "run python3 dashboards/grafana/generate.py"
    dash = json.loads(path.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    for wanted in ("Tiers", "Sessions", "Transfers", "Restore decisions", "Page cache", "NVMe"):
        assert wanted in rows
    assert any("fragmentation" in r for r in rows) and any("GPU" in r for r in rows)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["fieldConfig"]["defaults"]["unit"] in {
            "bytes",
            "Bps",
            "s",
            "percentunit",
            "ops",
            "iops",
            "short",
        }
        assert p["targets"], p["title"]


@needs_promtool
def test_fleet_row_draws_hosts_moves_and_shards(tmp_path: Path) -> None:
    """The fleet row: sessions per host, moves, L4 hit ratio per shard. The L4 shard families
    exist only with a Redis Cluster, so the end-to-end test cannot query them: promtool parses
    every expression of the row here instead (as recording rules, with the dashboard's
    variables filled in)."""
    dash = json.loads((REPO / "dashboards" / "grafana" / "kvtier.json").read_text())
    panels, row = {}, None
    for p in dash["panels"]:
        if p["type"] == "row":
            row = p["title"]
        elif row is not None and row.startswith("Fleet"):
            panels[p["title"]] = [t["expr"] for t in p["targets"]]
    assert set(panels) == {"Sessions per host", "Moves", "L4 hit ratio per shard"}
    assert "sum by (instance) (kvtier_sessions{" in panels["Sessions per host"][0]
    assert "kvtier_moved_sessions_total" in panels["Moves"][0]
    ratio = panels["L4 hit ratio per shard"][0]
    assert "kvtier_l4_shard_hits_total" in ratio and "kvtier_l4_shard_misses_total" in ratio
    exprs = [
        e.replace("$instance", ".+").replace("$__rate_interval", "1m")
        for es in panels.values()
        for e in es
    ]
    doc = {
        "groups": [
            {
                "name": "fleet",
                "rules": [{"record": f"kvtier:fleet_{i}", "expr": e} for i, e in enumerate(exprs)],
            }
        ]
    }
    (tmp_path / "fleet.yml").write_text(yaml.safe_dump(doc))
    out = subprocess.run(
        ["promtool", "check", "rules", str(tmp_path / "fleet.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
