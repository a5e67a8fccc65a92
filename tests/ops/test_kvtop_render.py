"""kvtop's screen from recorded /metrics texts: rich Console(record=True) at fixed sizes, the
text asserted. Layouts at 80x24 and 200x60, keys' effects, NO_COLOR, the endpoint-down line."""

from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from ops.kvtop import fmt, metrics
from ops.kvtop.app import Screen, State
from ops.kvtop.history import History
from ops.kvtop.metrics import Scrape
from ops.kvtop.model import Model, Options, SessionList, build, parse_sessions
from ops.kvtop.sources import Fetched

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
NOW = 1795987480.0  # a little after the recordings' last activity


def history(*names: str) -> History:
    h = History()
    for i, name in enumerate(names):
        h.add(metrics.parse((FIX / name).read_text(), 100.0 + i))
    return h


def live_model(options: Options | None = None, **kw: object) -> Model:
    sessions = parse_sessions((FIX / "exporter-live-sessions.json").read_text())
    return build(
        history("exporter-live-1.txt", "exporter-live-2.txt"),
        sessions,
        options or Options(),
        source="http://127.0.0.1:9481",
        interval=1.0,
        **kw,  # type: ignore[arg-type]
    )


def draw(model: Model, width: int, height: int, env: dict[str, str] | None = None) -> Console:
    console = Console(
        file=io.StringIO(),
        width=width,
        height=height,
        record=True,
        force_terminal=True,
        color_system="truecolor",
        _environ=env or {},
    )
    from ops.kvtop.render import screen

    console.print(screen(model, width, height, now=NOW))
    return console


def text(model: Model, width: int = 200, height: int = 60) -> list[str]:
    lines = draw(model, width, height).export_text().splitlines()
    return lines


@pytest.mark.parametrize("size", [(80, 24), (200, 60), (120, 40), (100, 30)])
def test_layout_fills_the_terminal_exactly(size: tuple[int, int]) -> None:
    width, height = size
    lines = text(live_model(), width, height)
    assert len(lines) == height
    assert all(len(line) <= width for line in lines)
    body = "\n".join(lines)
    for title in ("[1] Tiers", "[2] Sessions", "[3] Restore", "[4] Host"):
        assert title in body
    # every box closes: as many top-left as bottom-left corners
    assert body.count("╭") == body.count("╰") >= 4


def test_tiers_panel_shows_the_recorded_values() -> None:
    lines = text(live_model())
    l2 = next(line for line in lines if re.search(r"│ L2 ", line))
    # kvtier_tier_used_bytes{tier="l2"} 352256 = 344 KiB of 1 MiB, 43 chunks
    assert "344K/1.00M" in l2 and " 43 " in l2
    # into L2: l1->l2 244736 -> 250368 and l3->l2 +0: 5632 B/s = 5.50K/s; out 73216 = 71.5K/s
    assert "5.50K/s" in l2 and "71.5K/s" in l2
    l1 = next(line for line in lines if re.search(r"│ L1 ", line))
    assert "88.0K/1.00M" in l1 and "66.0K/s" in l1
    body = "\n".join(lines)
    assert "shed writes 0" in body and "checksum failures 0" in body


def test_sessions_panel_counts_and_top_list() -> None:
    body = "\n".join(text(live_model()))
    assert "active 1  idle 3  hibernated 2  pinned 1" in body
    assert "top 6 of 6 by bytes, active first" in body
    rows = [line for line in body.splitlines() if "agent-" in line]
    assert "agent-2" in rows[0] and "active" in rows[0]  # the one active session first
    assert "agent-5" in rows[1] and "idle*" in rows[1]  # then the pinned session, the largest
    assert "3/2/2" in rows[1] and "22.5K" in rows[1]  # 23040 bytes, L1/L2/L3 chunks
    assert "bytes ▼" in body


def test_sort_key_cycles_and_marks_the_column() -> None:
    state = State("x", 1.0, Options())
    headers = []
    for _ in range(5):
        state.key("s")
        body = "\n".join(text(dataclasses.replace(live_model(state.options))))
        headers.append(re.search(r"(\S+ [▼▲])", body).group(1))  # type: ignore[union-attr]
    assert headers == ["tokens ▼", "last ▼", "L1/L2/L3 ▼", "tenant ▲", "bytes ▼"]


def test_tenant_filter_prompt_and_result() -> None:
    state = State("x", 1.0, Options())
    for ch in "tglobex":
        state.key(ch)
    body = "\n".join(text(live_model(state.options)))
    assert "tenant filter (Enter applies, Esc cancels): globex_" in body
    state.key("\r")
    body = "\n".join(text(live_model(state.options)))
    rows = [line for line in body.splitlines() if "agent-" in line]
    assert rows and all("globex" in r for r in rows) and "tenant globex" in body
    state.key("t")
    for _ in "globex":
        state.key("\x7f")
    state.key("\n")
    assert state.options.tenant is None


def test_pause_help_focus_and_quit_keys() -> None:
    state = State("x", 1.0, Options())
    state.key("p")
    assert "PAUSED" in "\n".join(text(live_model(state.options)))
    state.key("p")
    assert "PAUSED" not in "\n".join(text(live_model(state.options)))
    state.key("?")
    help_text = "\n".join(text(live_model(state.options), 80, 24))
    assert "kvtop keys" in help_text and "cycle the sessions sort" in help_text
    assert state.key("x") and not state.options.help  # any key closes help
    state.key("4")
    focused = "\n".join(text(live_model(state.options), 80, 24))
    assert "[4] Host (focused" in focused and "[1] Tiers" not in focused
    state.key("4")
    assert state.options.focus is None
    assert state.key("q") is False


def test_no_color_gives_monochrome() -> None:
    """What reaches the terminal: colors by default, none under NO_COLOR (bold/dim stay)."""
    color = re.compile(r"\x1b\[[0-9;]*(3[0-7]|4[0-7]|38;|48;)[0-9;]*m")
    colored = draw(live_model(), 120, 40).file.getvalue()  # type: ignore[attr-defined]
    assert color.search(colored)
    mono = draw(live_model(), 120, 40, env={"NO_COLOR": "1"}).file.getvalue()  # type: ignore[attr-defined]
    assert not color.search(mono)
    assert "\x1b[1m" in mono  # still bold: monochrome, not plain
    assert "344K/1.00M" in mono  # same content


def test_endpoint_down_shows_a_message_and_keeps_last_data() -> None:
    state = State("http://127.0.0.1:1", 1.0, Options())
    state.fail("cannot reach http://127.0.0.1:1/metrics (Connection refused)", 5.0)
    first = " ".join(line.strip() for line in text(state.model(), 80, 24))
    assert "cannot reach http://127.0.0.1:1/metrics" in first and "Traceback" not in first
    assert "retrying every 1s" in first
    live = (FIX / "exporter-live-2.txt").read_text()
    state.ingest(Fetched(live, None, "no per-session list at this endpoint"), 6.0)
    state.fail("cannot reach http://127.0.0.1:1/metrics (Connection refused)", 18.0)
    body = " ".join(line.strip() for line in text(state.model(), 80, 24))
    assert "(data from 12s ago)" in body and "344K/1.00M" in body
    assert "no per-session list at this endpoint" in body


def test_gpu_pcie_and_host_lines_from_the_h200_recording() -> None:
    body = "\n".join(text(build(history("h200.txt"), None, Options(), source="x", interval=1.0)))
    assert "GPU0" in body and "gen5x16/gen5x16" in body
    # buddyinfo of the capture: order-9 and order-10 blocks 11 and 37 -> 11 + 2*37 = 85
    assert "o9+ 85" in body
    assert "L3 page cache hit 50%  resident 75%" in body
    assert "hugepages 0/0 free" in body
    assert "shares a PCIe" not in body  # host bridge only: not a shared uplink


def test_shared_switch_warning_and_downgraded_link() -> None:
    s = metrics.parse((FIX / "h200.txt").read_text(), 0.0)
    samples = {k: dict(v) for k, v in s.samples.items()}
    for key in samples["kvtier_gpu_l3_pcie_proximity"]:
        samples["kvtier_gpu_l3_pcie_proximity"][key] = 3.0  # what a shared switch reports
    samples["kvtier_gpu_pcie_link_width"] = {(("gpu", "0"),): 8.0}
    h = History()
    h.add(Scrape(0.0, samples))
    model = build(h, None, Options(), source="x", interval=1.0)
    body = "\n".join(text(model))
    assert "GPU0 shares a PCIe switch with the L3 drive" in body
    assert "gen5x8/gen5x16" in body
    assert "alerts (1): PcieLinkDowngraded GPU 0 link x8 of x16" in body


def test_serve_recording_without_host_metrics() -> None:
    sessions = parse_sessions((FIX / "serve-sessions.json").read_text())
    model = build(
        history("serve-1.txt", "serve-2.txt"), sessions, Options(), source="x", interval=1.0
    )
    body = "\n".join(text(model, 80, 24))
    assert "no host metrics at this endpoint" in body
    assert "(TTFT)" in body
    assert "running 0 queued 0" in body


def test_a_thousand_sessions_draw_only_what_fits() -> None:
    base = parse_sessions((FIX / "exporter-live-sessions.json").read_text()).sessions[0]
    many = tuple(
        dataclasses.replace(base, session_id=f"s{i:04d}", bytes=i * 1000, tokens=i)
        for i in range(1000)
    )
    h = history("exporter-live-1.txt", "exporter-live-2.txt")
    model = build(h, SessionList(many), Options(), source="x", interval=1.0)
    lines = text(model, 80, 24)
    assert len(lines) == 24
    rows = [line for line in lines if re.search(r"│\s+s\d{4}", line)]
    assert rows and "s0999" in rows[0] and "s0998" in rows[1]
    assert "of 1000 by bytes" in "\n".join(lines)


def test_formats() -> None:
    assert fmt.size(352256) == "344K" and fmt.size(1 << 20) == "1.00M" and fmt.size(5632) == "5.50K"
    assert fmt.size(None) == "-" and fmt.size(999) == "999"
    assert fmt.seconds(0.0005) == "500us" and fmt.seconds(0.25) == "250ms"
    assert fmt.age(75) == "1m" and fmt.count(12345) == "12.3k"
    assert fmt.spark([0, 1, 2, 4], 4) == " ▃▅█"
    assert fmt.bar(0.5, 4).plain == "██░░"


def test_screen_follows_console_size() -> None:
    console = Console(width=90, height=20, record=True, force_terminal=True)
    console.print(Screen(live_model()))
    assert len(console.export_text().splitlines()) == 20


# ---- 80x24 is clean: ids keep their distinct end, host fields are never cut -----------------


def host_box(lines: list[str]) -> list[str]:
    """The inside of the `[4] Host` box, one string per line (its borders dropped)."""
    top = next(i for i, line in enumerate(lines) if "╭─ [4] Host" in line)
    col = lines[top].index("╭─ [4] Host")
    out = []
    for line in lines[top + 1 :]:
        if line[col:].startswith("╰"):
            return out
        out.append(line[col + 1 :].split("│")[0].strip())
    raise AssertionError("the Host box does not close")


def loadgen_sessions(n: int) -> SessionList:
    """Ids as `kvtier loadgen` makes them: one run id, then the session number."""
    base = parse_sessions((FIX / "exporter-live-sessions.json").read_text()).sessions[0]
    return SessionList(
        tuple(
            dataclasses.replace(base, session_id=f"lg-ca4283a0-{i:05d}", bytes=1000 + i)
            for i in range(n)
        )
    )


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_session_ids_keep_the_part_that_tells_them_apart(size: tuple[int, int]) -> None:
    h = history("exporter-live-1.txt", "exporter-live-2.txt")
    model = build(h, loadgen_sessions(32), Options(), source="x", interval=1.0)
    lines = text(model, *size)
    ids = [line.split()[1] for line in lines if re.match(r"│ lg-", line)]
    assert len(ids) >= 4 and len(set(ids)) == len(ids), ids
    assert ids[0].endswith("-00031") and ids[1].endswith("-00030")  # largest bytes first
    assert all(i.startswith("lg-") for i in ids)


def test_middle_ellipsis() -> None:
    from ops.kvtop.render import _cut

    assert _cut("lg-ca4283a0-00017", 12) == "lg-ca…-00017"
    assert _cut("agent-5", 12) == "agent-5" and _cut("abcdefghijklm", 12) == "abcde…hijklm"
    assert len(_cut("x" * 50, 36)) == 36


def h200_model(split: float | None = None, retries: tuple[float, float] | None = None) -> Model:
    """The H200 recording (twice, 1 s apart), optionally with other allocator figures."""
    h = History()
    for i in range(2):
        s = metrics.parse((FIX / "h200.txt").read_text(), 100.0 + i)
        samples = {k: dict(v) for k, v in s.samples.items()}
        if split is not None:
            samples["kvtier_torch_inactive_split_bytes"] = {(("gpu", "0"),): split}
        if retries is not None:
            samples["kvtier_torch_alloc_retries_total"] = {(("gpu", "0"),): retries[i]}
        samples["kvtier_gpu_l3_pcie_proximity"] = {
            k: 3.0 for k in samples["kvtier_gpu_l3_pcie_proximity"]
        }  # the longest host panel: with the shared-switch warning
        h.add(Scrape(s.taken_at, samples))
    return build(h, None, Options(), source="x", interval=1.0)


@pytest.mark.parametrize("size", [(80, 24), (100, 30), (120, 40), (200, 60)])
@pytest.mark.parametrize("which", ["live", "h200"])
def test_host_fields_are_never_cut(size: tuple[int, int], which: str) -> None:
    model = live_model() if which == "live" else h200_model()
    lines = text(model, *size)
    box = host_box(lines)
    assert box and not any("…" in line for line in box), "\n".join(box)
    body = " ".join(box)
    if size[1] >= 40 or size[0] >= 160:  # room for all of it
        assert "more lines" not in body
        assert "o9+" in body and "L3 filesystem" in body
        if which == "h200":
            assert "GPU0 shares a PCIe switch with the L3 drive" in body
            assert "alloc 6.00G split 4% retries 1" in body
    else:  # what does not fit is counted, and focusing the panel shows it
        assert "o9+" in body
        if "more lines" in body:
            focused = dataclasses.replace(model, options=Options(focus=4))
            whole = " ".join(host_box(text(focused, *size)))
            assert "more lines" not in whole and "L3 filesystem" in whole


def test_allocator_cue_and_alerts() -> None:
    reserved = 6.442450944e09  # the recording's kvtier_torch_reserved_bytes
    model = h200_model(split=0.4 * reserved, retries=(1.0, 3.0))
    lines = text(model, 200, 60)
    body = "\n".join(lines)
    assert "alloc 6.00G split 40% retries 3↑" in " ".join(host_box(lines))
    assert "GpuAllocatorFragmented GPU 0 2.40G (40%) of 6.00G reserved" in body
    assert "GpuAllocatorRetries GPU 0 2 cudaMalloc retries" in body
    quiet = "\n".join(text(h200_model(), 200, 60))
    assert "GpuAllocator" not in quiet and "alerts: none would fire now" in quiet


def test_header_drops_words_before_figures_in_a_narrow_terminal() -> None:
    model = dataclasses.replace(live_model(), source="http://127.0.0.1:34881", interval=0.5)
    wide = text(model, 120, 40)[0]
    assert "every 0.5s" in wide and "http://127.0.0.1:34881" in wide
    narrow = text(model, 80, 24)[0]
    assert "…" not in narrow and narrow.rstrip().endswith("? help")
    assert "kvtop 127.0.0.1:34881  0.5s  sort bytes" in narrow
