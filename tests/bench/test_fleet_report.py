"""bench/fleet_report.py: the configuration names that change the scheduler's settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from fleet_report import variant


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("kvtier-b128", {"b": 128}),
        ("kvtier-p256", {"p": 256}),
        ("kvtier-b128-p256", {"b": 128, "p": 256}),
        ("kvtier-b128-p256-shortest", {"b": 128, "p": 256, "shortest": 1}),
        ("kvtier-shortest", {"shortest": 1}),
        ("kvtier-dg", {"dg": 1}),
        ("kvtier-unfused", {"unfused": 1}),
        ("kvtier-nodg", {"nodg": 1}),
        ("kvtier-b96-p256-dg", {"b": 96, "p": 256, "dg": 1}),
        ("kvtier-fused", {}),  # fused is the default: no such switch
        ("kvtier", {}),
        ("kvtier-int8", {}),
        ("kvtier-b", {}),  # no number: not a variant (the bench reports it unknown)
        ("ceiling", {}),
    ],
)
def test_variant_names(name: str, settings: dict[str, int]) -> None:
    assert variant(name) == settings


@pytest.mark.parametrize(
    ("scenario", "rate", "state"),
    [
        ("fit", 4493.0, "missed"),
        ("fit", 6100.0, "met"),
        ("hibernate", 2900.0, "missed"),
        ("hibernate", 3925.0, "met"),
    ],
)
def test_throughput_targets(scenario: str, rate: float, state: str) -> None:
    """A kvtier row's tok/s against the scenario's target (issue figures: 6,000 fit, 3,000
    hibernate), as the bench prints and plots it."""
    from fleet_report import TOK_S_TARGET, targets

    nan = float("nan")
    row = {"config": "kvtier", "tok_s": rate, "x_ceiling": nan, "oom": 0}
    row |= {"ttft_p50": nan, "ttft_p99": nan, "step_p50": nan, "step_p99": nan}
    checks = {c["target"]: c["state"] for c in targets(scenario, [row])}
    assert checks[f"kvtier: >= {TOK_S_TARGET[scenario]:,} tok/s"] == state
