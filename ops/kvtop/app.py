"""kvtop entry point: the refresh loop, key handling and the two source modes.

A fetcher thread reads the source every `--interval` seconds and posts results on a queue; the
main thread owns the history and the screen and handles keys, so a slow or dead endpoint never
freezes the keyboard. Errors become a line on screen and the fetcher keeps retrying.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import click

from kvtier.errors import KvtierError
from ops.kvtop import metrics
from ops.kvtop.history import History
from ops.kvtop.model import SORTS, Model, Options, SessionList, build
from ops.kvtop.sources import DEFAULT_URLS, Fetched, HttpSource, L3Source, Source, probe

if TYPE_CHECKING:  # rich's console and the renderer load when a frame is drawn, not for --help
    from rich.console import Console, ConsoleOptions, RenderResult


class Screen:
    """A model drawn at whatever size the console has when rich renders it (resizes follow)."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from ops.kvtop.render import screen

        height = options.height or console.height
        yield screen(self.model, options.max_width, height)


class State:
    """What the main thread keeps between frames: the scrapes, the last list, the options."""

    def __init__(self, source: str, interval: float, options: Options) -> None:
        self.history = History()
        self.sessions: SessionList | None = None
        self.detail: str | None = None
        self.error: str | None = None
        self.last_ok: float | None = None
        self.options = options
        self.source = source
        self.interval = interval

    def ingest(self, fetched: Fetched, taken_at: float) -> None:
        try:
            scrape = metrics.parse(fetched.metrics, taken_at)
        except metrics.MetricsFormatError as exc:
            self.error = str(exc)
            return
        self.history.add(scrape)
        self.sessions, self.detail = fetched.sessions, fetched.detail
        self.error, self.last_ok = None, taken_at

    def fail(self, message: str, taken_at: float) -> None:
        stale = f" (data from {taken_at - self.last_ok:.0f}s ago)" if self.last_ok else ""
        retry = "" if self.options.once else f"; retrying every {self.interval:g}s"
        self.error = f"{message}{retry}{stale}"

    def model(self) -> Model:
        return build(
            self.history,
            self.sessions,
            self.options,
            source=self.source,
            interval=self.interval,
            error=self.error,
            detail=self.detail,
        )

    def key(self, ch: str) -> bool:
        """Apply one key; False means quit."""
        o = self.options
        typed = o.prompt
        if typed is not None:
            if ch in ("\r", "\n"):
                o = dataclasses.replace(o, tenant=typed.strip() or None, prompt=None)
            elif ch == "\x1b":
                o = dataclasses.replace(o, prompt=None)
            elif ch in ("\x7f", "\b"):
                o = dataclasses.replace(o, prompt=typed[:-1])
            elif ch.isprintable():
                o = dataclasses.replace(o, prompt=typed + ch)
            self.options = o
            return True
        if o.help:
            self.options = dataclasses.replace(o, help=False)
            return ch not in ("q", "Q")
        if ch in ("q", "Q"):
            return False
        if ch == "p":
            o = dataclasses.replace(o, paused=not o.paused)
        elif ch == "s":
            o = dataclasses.replace(o, sort=SORTS[(SORTS.index(o.sort) + 1) % len(SORTS)])
        elif ch == "t":
            o = dataclasses.replace(o, prompt=o.tenant or "")
        elif ch in "1234" and len(ch) == 1:
            o = dataclasses.replace(o, focus=None if o.focus == int(ch) else int(ch))
        elif ch in ("0", "\x1b"):
            o = dataclasses.replace(o, focus=None)
        elif ch in ("?", "h"):
            o = dataclasses.replace(o, help=True)
        self.options = o
        return True


def _fetcher(
    source: Source,
    interval: float,
    events: queue.Queue[tuple[str, Any]],
    stop: threading.Event,
    paused: threading.Event,
) -> None:
    while not stop.is_set():
        started = time.monotonic()
        if not paused.is_set():
            try:
                events.put(("data", (source.fetch(), time.monotonic())))
            except KvtierError as exc:
                events.put(("error", (str(exc), time.monotonic())))
            except Exception as exc:  # shown on screen; the loop must outlive any one failure
                events.put(("error", (f"{type(exc).__name__}: {exc}", time.monotonic())))
        stop.wait(max(0.0, interval - (time.monotonic() - started)))


def run(source: Source, interval: float, options: Options, console: Console) -> None:
    """The live screen until `q` (or Ctrl-C)."""
    from rich.live import Live

    from ops.kvtop.keys import keyboard

    state = State(source.name, interval, options)
    events: queue.Queue[tuple[str, Any]] = queue.Queue()
    stop, paused = threading.Event(), threading.Event()
    fetcher = threading.Thread(
        target=_fetcher, args=(source, interval, events, stop, paused), daemon=True
    )
    fetcher.start()
    try:
        with (
            keyboard(events),
            Live(
                Screen(state.model()),
                console=console,
                screen=True,
                auto_refresh=False,
                redirect_stdout=False,
                redirect_stderr=False,
            ) as live,
        ):
            while True:
                kind, payload = events.get()
                if kind == "key":
                    if not state.key(payload):
                        break
                    paused.set() if state.options.paused else paused.clear()
                elif state.options.paused:
                    continue
                elif kind == "data":
                    state.ingest(*payload)
                elif kind == "error":
                    state.fail(*payload)
                if events.empty():
                    live.update(Screen(state.model()), refresh=True)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        source.close()


def once(source: Source, interval: float, options: Options, console: Console) -> int:
    """Two scrapes `interval` apart (so rates exist), one frame printed; exit 1 if unreachable."""
    state = State(source.name, interval, dataclasses.replace(options, once=True))
    ok = False
    for i in range(2):
        try:
            state.ingest(source.fetch(), time.monotonic())
            ok = True
        except KvtierError as exc:
            state.fail(str(exc), time.monotonic())
        if i == 0:
            time.sleep(interval)
    console.print(Screen(state.model()))
    source.close()
    return 0 if ok else 1


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--url",
    help="Base URL of a kvtier serve or kvtier exporter "
    f"[default: the first of {', '.join(DEFAULT_URLS)} that answers].",
)
@click.option(
    "--l3-root",
    type=click.Path(file_okay=False, path_type=str),
    help="No server: read this L3 store's index (read-only) and the host collectors.",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Refresh period in seconds.",
)
@click.option("--sort", type=click.Choice(SORTS), default="bytes", show_default=True)
@click.option("--tenant", help="Show only this tenant's sessions.")
@click.option("--no-gpu", is_flag=True, help="With --l3-root: skip NVML queries.")
@click.option("--once", "once_flag", is_flag=True, help="Print one frame (after two scrapes).")
@click.option(
    "--api-key",
    envvar="KVTIER_API_KEY",
    help="For a server with --api-keys (also KVTIER_API_KEY): an admin key lists every "
    "tenant's sessions, a tenant key its own.",
)
def main(
    url: str | None,
    l3_root: str | None,
    interval: float,
    sort: str,
    tenant: str | None,
    no_gpu: bool,
    once_flag: bool,
    api_key: str | None,
) -> None:
    """Live terminal view of kvtier's tiers, sessions, restores and host signals.

    Keys: q quit, p pause, s sort, t tenant filter, 1-4 focus a panel, ? help.
    """
    if url and l3_root:
        raise click.UsageError("give --url or --l3-root, not both")
    source: Source
    if l3_root is not None:
        try:
            source = L3Source(l3_root, nvml=not no_gpu)
        except KvtierError as exc:
            raise click.UsageError(str(exc)) from None
    else:
        source = HttpSource(url or probe() or DEFAULT_URLS[0], api_key=api_key)
    from rich.console import Console

    console = Console()
    options = Options(sort=sort, tenant=tenant)
    if once_flag:
        raise SystemExit(once(source, interval, options, console))
    run(source, interval, options, console)
