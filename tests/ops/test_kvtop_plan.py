"""kvtop's GPU plan row: `kvtier serve`'s GPU memory plan (the bytes held against the budget,
each part's bytes) in the Host panel, from the server's own exposition; no row at an endpoint
without a plan (the CPU, the exporter); the KvtierGpuBudgetExceeded alert past the budget."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import generate_latest
from test_exporter_inputs import GIB, h200_plan, server_registry
from test_kvtop_l4 import live_history
from test_kvtop_render import FIX, host_box, text

from ops.kvtop import metrics
from ops.kvtop.metrics import Scrape
from ops.kvtop.model import PLAN_PARTS, Model, Options, build, gpu_plan, parse_sessions

PLAN_FAMILIES = (
    "kvtier_gpu_memory_bytes",
    "kvtier_gpu_memory_budget_bytes",
    "kvtier_gpu_memory_process_bytes",
)


def plan_model(used: float | None = 100 * GIB, options: Options | None = None) -> Model:
    """The exporter recording, then one scrape more with `kvtier serve`'s GPU memory plan as
    ServerMetrics exposes it (an H200 at 0.9); None: no plan at this endpoint."""
    src = live_history(l4=False)
    cur = src.latest
    assert cur is not None
    samples = {k: dict(v) for k, v in cur.samples.items()}
    if used is not None:
        served = generate_latest(server_registry(h200_plan(used=int(used)))).decode()
        plan = metrics.parse(served, cur.taken_at).samples
        samples |= {k: dict(v) for k, v in plan.items() if k in PLAN_FAMILIES}
    src.add(Scrape(cur.taken_at + 1.0, samples))
    sessions = parse_sessions((FIX / "exporter-live-sessions.json").read_text())
    return build(src, sessions, options or Options(), source="x", interval=1.0)


def test_plan_figures_from_the_server_exposition() -> None:
    plan = plan_model().plan
    assert plan is not None
    expected = h200_plan()
    assert plan.budget == expected.budget_bytes
    assert plan.used == 100 * GIB
    assert plan.parts == tuple((p, float(n)) for p, n in expected.parts().items())
    assert [p for p, _ in plan.parts] == list(PLAN_PARTS)
    assert sum(n for _, n in plan.parts) == plan.budget
    assert plan.ratio == pytest.approx(100 * GIB / expected.budget_bytes)
    assert plan_model(None).plan is None


def test_parts_in_plan_order_whatever_the_exposition_order() -> None:
    parts = {(("part", p),): float(i) for i, p in enumerate(reversed(PLAN_PARTS))}
    parts[(("part", "spare"),)] = 9.0  # a part kvtop does not know comes last
    cur = Scrape(
        0.0,
        {
            "kvtier_gpu_memory_bytes": parts,
            "kvtier_gpu_memory_budget_bytes": {(): 100.0},
        },
    )
    plan = gpu_plan(cur)
    assert plan is not None and plan.used is None and plan.ratio is None
    assert [p for p, _ in plan.parts] == [*PLAN_PARTS, "spare"]


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 60)])
def test_plan_row_in_the_host_panel(size: tuple[int, int]) -> None:
    box = host_box(text(plan_model(), *size))
    body = " ".join(box)
    assert "GPU plan" in body and "100G/118G 85%" in body, "\n".join(box)
    assert not any("…" in line for line in box), "\n".join(box)
    if size[0] < 160:  # compact: the bytes held first, right after the memory line
        mem = next(i for i, line in enumerate(box) if line.startswith("mem avail"))
        assert box[mem + 1 + ("PSI io" in box[mem + 1])].startswith("GPU plan ")
    if size[1] >= 40:  # room for every part
        for part in ("context 800M", "weights 16.0G", "activations 3.00G", "graphs 2.00G"):
            assert part in body
        assert "l1 160M" in body and "inflight 512M" in body and "pool 94.7G" in body
        assert "staging 512M" in body and "headroom 512M" in body
    whole = " ".join(host_box(text(plan_model(options=Options(focus=4)), *size)))
    assert "more lines" not in whole and "pool 94.7G" in whole and "headroom 512M" in whole


@pytest.mark.parametrize("size", [(80, 24), (200, 60)])
def test_no_plan_no_row(size: tuple[int, int]) -> None:
    assert "GPU plan" not in "\n".join(text(plan_model(None), *size))


def test_over_the_budget_raises_the_alert() -> None:
    budget = h200_plan().budget_bytes
    lines = text(plan_model(used=1.1 * budget), 200, 60)
    body = "\n".join(lines)
    assert "GpuBudgetExceeded GPU 130G held > budget 118G (110%)" in body
    assert "130G/118G 110%" in " ".join(host_box(lines))
    assert "GpuBudgetExceeded" not in "\n".join(text(plan_model(), 200, 60))


def test_levels_of_the_used_share() -> None:
    """Green inside the plan, yellow once the bytes held eat into its headroom, red past the
    budget (the alert's threshold)."""
    from ops.kvtop.host import _plan_row

    plan = plan_model().plan
    assert plan is not None
    headroom = dict(plan.parts)["headroom"]

    def style(used: float) -> str:
        head = _plan_row(dataclasses.replace(plan, used=used))[0]
        return str(head.spans[-1].style)

    assert style(plan.budget - headroom) == "green"
    assert style(plan.budget - headroom + 1) == "yellow"
    assert style(plan.budget) == "yellow"
    assert style(plan.budget + 1) == "bold red"
