"""docs/metrics.md and the exporter must agree: names, types and label sets, both ways."""

from __future__ import annotations

import re
from pathlib import Path

from test_exporter_inputs import full_registry, scrape, server_registry

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
NAME = re.compile(r"^`(kvtier_[a-z0-9_]+)`$")


def documented() -> dict[str, tuple[str, set[str], str]]:
    """Metric name -> (type, labels, source) from the tables of docs/metrics.md."""
    rows: dict[str, tuple[str, set[str], str]] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = NAME.match(cells[0])
        if m and len(cells) == 6:
            name, (kind, _unit, labels, source, _meaning) = m.group(1), cells[1:]
            assert name not in rows, f"{name} is documented twice"
            rows[name] = (kind, {x.strip() for x in labels.split(",") if x.strip()}, source.strip())
    return rows


def test_doc_table_parses() -> None:
    rows = documented()
    assert len(rows) > 60, "the metrics tables of docs/metrics.md no longer parse"


def exported_by_serve(tmp_path: Path) -> dict[str, tuple[str, set[str], dict]]:
    """Every family of `kvtier serve`'s /metrics: the exporter's and the server's own (without
    prometheus_client's `_created` gauges, which the server turns off: none is documented)."""
    return scrape(full_registry(tmp_path)) | scrape(server_registry())


def test_every_exported_metric_is_documented_and_vice_versa(tmp_path: Path) -> None:
    exported = exported_by_serve(tmp_path)
    doc = documented()
    missing = sorted(set(exported) - set(doc))
    stale = sorted(set(doc) - set(exported))
    assert not missing, f"exported but not in docs/metrics.md: {missing}"
    assert not stale, f"in docs/metrics.md but never exported: {stale}"
    for name, (kind, labels, _) in doc.items():
        got_kind, got_labels, _ = exported[name]
        assert got_kind == kind, f"{name}: docs say {kind}, exporter says {got_kind}"
        assert got_labels == labels, f"{name}: docs say labels {labels}, exporter {got_labels}"


def test_names_follow_the_conventions() -> None:
    allowed_labels = {"tier", "src", "dst", "device", "gpu", "node", "zone", "order"}
    allowed_labels |= {"state", "queue"}  # bounded by kvtier.types / the transfer engine
    allowed_labels |= {"direction", "op"}  # L4: read/written, get/put
    allowed_labels |= {"generation", "part"}  # gc generations 0-2, the GPU plan's eight parts
    allowed_labels |= {"endpoint", "code"}  # the server's route templates, HTTP status codes
    allowed_labels |= {"reason"}  # a 400's error code: the server's own few
    allowed_labels |= {"shard", "slots"}  # a Redis Cluster's primaries and their slot ranges
    for name, (kind, labels, _) in documented().items():
        assert labels <= allowed_labels, f"{name}: unbounded label in {labels}"
        assert (kind == "counter") == name.endswith("_total"), f"{name}: _total iff counter"
        for bad in ("_ms", "_kb", "_mb", "_percent", "_milliseconds", "_kilobytes"):
            assert bad not in name, f"{name}: not a base unit"


PLAN_FAMILIES = (
    "kvtier_gpu_memory_bytes",
    "kvtier_gpu_memory_budget_bytes",
    "kvtier_gpu_memory_process_bytes",
)


def test_every_server_family_is_documented(tmp_path: Path) -> None:
    """Each `kvtier_server_*` family of kvtier.server.metrics has its row, the GPU plan's with
    the `GPU plan` source (absent on the CPU: a panel on them may stay empty there)."""
    doc = documented()
    exported = exported_by_serve(tmp_path)
    server = [n for n in exported if n.startswith("kvtier_server_")]
    assert len(server) >= 25
    assert {n for n in doc if n.startswith("kvtier_server_")} == set(server)
    plan = {n for n in exported if n in PLAN_FAMILIES}
    assert plan == {
        "kvtier_gpu_memory_bytes",
        "kvtier_gpu_memory_budget_bytes",
        "kvtier_gpu_memory_process_bytes",
    }
    assert {doc[n][2] for n in plan} == {"GPU plan"}
    assert {doc[n][2] for n in server} == {"server"}
