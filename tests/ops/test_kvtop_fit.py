"""No field is cut at 80x24, 120x40 or 160x48: the screen drawn by rich at a fixed size holds
every value's whole text, and no ellipsis. The values are worked out here from the model with
kvtop's formats, not read back from the renderer: the recordings of a real `kvtier serve`, of
the exporter (with paged L1, with an L4) and of an H200 host, and the serve recording with the
widest figures each field can take (four-digit counters and a lost device beside them, TTFT
percentiles like `12.3ms` and `9.95s`, restore counts like `12.3k`)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from test_kvtop_fill import paged_model, serve_model
from test_kvtop_l4 import model as l4_model
from test_kvtop_render import h200_model, text

from ops.kvtop import fmt
from ops.kvtop.model import Counter, Model, RestoreRow
from ops.kvtop.render import tier_label

SIZES = [(80, 24), (120, 40), (160, 48)]


def widest() -> Model:
    """The serve recording with figures as wide as their formats make them."""
    m = serve_model()
    counters = (
        *m.counters,
        Counter("degraded turns", 1234.0, 2.5),
        Counter("lost devices", 1.0, None),
    )
    restore = tuple(
        RestoreRow(
            src=src,
            decisions=12345.0,
            rate=123.0,
            share=1.0 if src == "recompute" else 0.0,
            tokens=12345.0,
            quantiles=(0.0123, 0.456, 9.95),
            observed=12345.0,
            recent=src != "l3",
        )
        for src in ("l1", "l2", "l3", "recompute")
    )
    return dataclasses.replace(m, counters=counters, restore=restore)


MODELS = {
    "serve": serve_model,
    "widest": widest,
    "paged": paged_model,
    "l4": l4_model,
    "h200": h200_model,
}


def expected(model: Model) -> list[str]:
    """Every field kvtop draws outside the Host panel (test_kvtop_render checks that one)."""
    paged = model.paged_l1
    out = []
    for t in model.tiers:
        used, cap, chunks = t.used, t.capacity, t.chunks
        if t.name == "l1" and paged is not None:
            used, cap, chunks = paged.used, paged.capacity, paged.chunks
        hit = t.hit_ratio_recent if t.hit_ratio_recent is not None else t.hit_ratio
        out += [tier_label(t.name, paged is not None), f"{fmt.size(used)}/{fmt.size(cap)}"]
        out += [fmt.count(chunks), fmt.pct(hit), fmt.rate(t.in_rate), fmt.rate(t.out_rate)]
    for c in model.counters:
        out.append(f"{c.name} {fmt.count(c.total)}")
        if c.rate:
            out.append(f"(+{fmt.per_s(c.rate)}/s)")
    for state, nbytes in model.pool:
        out.append(f"{state} {fmt.size(nbytes)}")
    if paged is not None:
        out.append(f"L1 buffers {fmt.size(paged.staging[0])}/{fmt.size(paged.staging[1])}")
    if model.l4 is not None:
        v = model.l4
        out += [f"hit {fmt.pct(v.hit_ratio)}", f"errors {fmt.count(v.errors)}"]
        out += [f"get {fmt.seconds(v.get_seconds)} put {fmt.seconds(v.put_seconds)}"]
        out += [f"read {fmt.rate(v.read_rate)} write {fmt.rate(v.write_rate)}"]
    return out


def restore_cells(r: RestoreRow) -> list[str]:
    """A restore row's cells in both layouts: the source, `n`, the share, p50 and p99."""
    q = r.quantiles
    return [r.src, fmt.count(r.observed), fmt.pct(r.share), fmt.seconds(q[0]), fmt.seconds(q[2])]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("which", sorted(MODELS))
def test_no_field_is_cut(size: tuple[int, int], which: str) -> None:
    model = MODELS[which]()
    lines = text(model, *size)
    body = "\n".join(lines)
    assert len(lines) == size[1] and "…" not in body, body
    flat = " ".join(body.split())  # a field flowed onto the next line is still whole
    for value in expected(model):
        assert value in flat, f"{value!r} missing at {size}:\n{body}"
    for r in model.restore:
        row = next((ln for ln in lines if re.search(rf"│ {r.src} ", ln)), None)
        assert row is not None, f"no {r.src} row at {size}:\n{body}"
        cells = row.split("│ " + r.src, 1)[1].split("│")[0].split()
        for cell in restore_cells(r)[1:]:
            assert cell in cells, f"{r.src}: {cell!r} not in {cells}"
    for title in ("[1] Tiers", "[2] Sessions", "[3] Restore", "[4] Host"):
        assert title in body
    if model.sessions.pinned is not None:
        shown = int(re.search(r"top (\d+) of", body).group(1))  # type: ignore[union-attr]
        for s in model.sessions.rows[:shown]:
            assert re.search(rf"│ {re.escape(s.session_id)} +{re.escape(s.tenant)} ", body)


def box_width(lines: list[str], title: str) -> int:
    line = next(ln for ln in lines if f"╭─ {title}" in ln)
    start = line.index(f"╭─ {title}")
    return line.index("╮", start) - start + 1


@pytest.mark.parametrize("which", sorted(MODELS))
def test_the_tiers_panel_grows_with_the_terminal(which: str) -> None:
    model = MODELS[which]()
    widths = [box_width(text(model, *size), "[1] Tiers") for size in SIZES]
    assert widths == [80, 120, 160]


def test_active_sessions_come_first_in_the_default_sort() -> None:
    """The largest sessions of the recording are hibernated; an 80x24 screen lists the active
    and idle ones before them, each group by bytes."""
    model = l4_model()
    rows = model.sessions.rows
    ranks = [{"active": 0, "idle": 1}.get(s.state, 2) for s in rows]
    assert ranks == sorted(ranks) and ranks[0] == 0, [(s.session_id, s.state) for s in rows]
    idle = [s.bytes for s in rows if s.state == "idle"]
    assert idle == sorted(idle, reverse=True)
    by_bytes = max(model.sessions.rows, key=lambda s: s.bytes)
    assert by_bytes.state != "active"  # what the sort would have put first by bytes alone
    body = "\n".join(text(model, 80, 24))
    first = next(ln for ln in body.splitlines() if re.match(r"│ agent-", ln))
    assert "active" in first and "by bytes, active first" in body
