"""Device failover for a model placed across devices: healthy -> draining -> degraded -> healthy.

A device is lost when a forward raises a CUDA error that a probe of the device confirms, when
NVML reports the GPU gone (`NvmlWatch`), or when a fault is injected (`POST
/v1/admin/devices/{n}/fail`, or `inject_mid_batch` in tests). Transitions run on the batch
scheduler's thread, between two steps, so no forward ever sees a half-moved model:

1. *draining*: every running sequence leaves the page pool. Its pages are dropped unread (a
   lost device's memory is worth nothing); what its session's Cache holds stays there (L1 on the
   primary device, L2, L3), and the sequence waits at the head of the queue with every token it
   has (prompt and the reply so far), so nothing is lost and nothing is sent twice;
2. the lost device's layers are loaded onto the survivors from the host copy of the weights
   (`PlacedModel.replace`);
3. the page pool is rebuilt on the survivors, at most as many bytes on each as it had before
   (so it holds fewer tokens: the scheduler admits fewer sessions at once);
4. *degraded*: the queued sequences are admitted again, copy their cached K/V in, recompute the
   tokens that were only in the lost pages, and continue; their next tokens are the ones a
   healthy server computes.

`restore(n)` runs the same way back: running sequences are preempted (their K/V, valid here,
goes to their session's Cache), the layers return to their home devices, the pool is rebuilt at
its first size, and the state is *healthy* again.

Losing the *primary* device (embeddings, final norm, LM head, the batch's buffers, the session
L1 of the tiered cache) fails over the same way, with more to move. Between steps 1 and 2 the
commits in flight finish (they write into L1). In step 2 the survivor that takes layer 0 becomes
the primary: the embeddings, norm, LM head and rotary tables are loaded there from the host copy
too. Then the sampler's vocabulary mask is rebuilt there from its host copy, and the cache's L1
and the device side of its transfer engine move there (`TieredCache.move_l1`): L1's contents
are dropped unread, every resident session keeps the prefix L2/L3 hold (write-through stores
each full chunk at commit) and recomputes the rest at its next turn, and each queued sequence
restores its session's stored prefix into the new L1 (`TieredCache.reload_session`) and
recomputes the tokens after it (the rest of its prompt, its reply so far): no KV is read from
the lost device, no session is lost. Step 3 builds the pool and the runner's buffers on the
new primary. `restore(n)` of the home primary moves everything back: idle sessions are first
hibernated from the survivor's L1 (which works), so they resume from L2 with their whole
prefix. Only losing every device is *failed*: the server must restart; its sessions resume from
L2/L3 then.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.errors import ConfigError, KvtierError
from kvtier.geometry import KVGeometry
from kvtier.paged import BatchRunner, PagePool
from kvtier.paged.sharded import ShardedPagePool
from kvtier.placement import (
    DeviceLost,
    PlacedModel,
    Placement,
    decoder_layers,
    devices_setting,
    parse_devices,
)
from kvtier.server.config import ServerConfig
from kvtier.server.devices import rehome
from kvtier.server.devices.streaming import pool_kv

log = logging.getLogger("kvtier.server")

HEALTHY, DRAINING, DEGRADED, RESTORING = "healthy", "draining", "degraded", "restoring"
FAILED = "failed"  # every device is lost: the server must restart
STATES = (HEALTHY, DRAINING, DEGRADED, RESTORING, FAILED)


def make_pool(
    served: Any, geometry: KVGeometry, budget: int, page_size: int, dtype: torch.dtype
) -> PagePool:
    """The batch's page pool: sharded by layer where the model is placed across devices."""
    devices = getattr(served, "devices", None)
    if devices is None:
        return PagePool(geometry, budget, page_size=page_size, device=served.device, dtype=dtype)
    pool = ShardedPagePool(
        geometry, budget, devices.placed.placement, page_size=page_size, dtype=dtype
    )
    devices.home_budget = devices.home_budget or pool.num_pages * pool.page_bytes
    return pool


def probe(device: torch.device) -> str | None:
    """None when a small computation on `device` completes; else why it does not."""
    try:
        x = torch.ones(8, device=device)
        float((x * 2).sum())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # a lost GPU raises from any call on it
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


@dataclass(frozen=True)
class _PoolShape:
    geometry: KVGeometry
    page_size: int
    dtype: torch.dtype
    page_bytes: int


class SchedulerPort(Protocol):
    """What failover asks of the batch scheduler that owns the model
    (`kvtier.server.batch.batching.BatchScheduler`); nothing else of it is touched."""

    config: ServerConfig
    served: Any
    max_batch: int
    batch_tokens: int

    def locked(self) -> AbstractContextManager[Any]:
        """The scheduler's lock (re-entrant), held while a request is queued for its thread."""
        ...

    def wakeup(self) -> None:
        """Wake its thread: a request waits."""
        ...

    def evacuate(self, keep: bool) -> None:
        """Every running sequence back to the head of the queue (`keep`: its K/V first goes to
        its session's Cache; else its pages are dropped unread)."""
        ...

    def detach_pool(self) -> PagePool:
        """Let go of the page pool and the runner; returns the pool."""
        ...

    def install_pool(self, pool: PagePool, runner: BatchRunner) -> None:
        """A new page pool and runner."""
        ...


LAST_DEVICE = (
    "it is the last device left (the primary: embeddings, LM head, the batch, the session "
    "L1); restore another device first, or restart the server"
)


class DeviceFailover:
    """The device state machine of one placed model (see the module docstring).

    Thread-safe requests (`fail`, `restore`) are applied by the attached batch scheduler's
    thread at its next iteration (`poll`), or at once when no scheduler is attached.
    """

    def __init__(self, placed: PlacedModel, metrics: Any = None) -> None:
        self.placed = placed
        self.metrics = metrics
        self.state = HEALTHY
        self.reason = ""
        self.home_budget = 0
        self.history: list[str] = [HEALTHY]
        self.last_failover_s: float | None = None  # fault seen -> serving again, seconds
        self.failovers = 0
        self.scheduler: SchedulerPort | None = None
        self.watch: NvmlWatch | None = None  # set where GPUs are watched (place_configured)
        self.allowed: torch.Tensor | None = None  # host copy of the sampler's mask (place)
        self.served: Any = None  # the ServedModel placed (place)
        self.home_l1: int | None = None  # the cache's L1 bytes on the home primary
        self._lock = threading.Lock()
        self._requests: list[tuple[str, int, str, concurrent.futures.Future[dict[str, Any]]]] = []
        self._report()

    # ---- requests (any thread) ---------------------------------------------------------------

    @property
    def pending(self) -> bool:
        return bool(self._requests)

    def attach(self, scheduler: SchedulerPort) -> None:
        """The batch scheduler that owns the model; transitions run on its thread from now on."""
        self.scheduler = scheduler

    def fail(self, device: int, reason: str = "fault injected") -> concurrent.futures.Future[Any]:
        """Treat `device` as lost; the future resolves with `status()` once serving again."""
        return self._request("fail", device, reason)

    def restore(self, device: int) -> concurrent.futures.Future[Any]:
        """Bring `device` back: its layers return; the future resolves with `status()`."""
        return self._request("restore", device, "")

    def inject_mid_batch(self, device: int, reason: str = "fault injected mid-batch") -> None:
        """Test hook: the next forward raises `DeviceLost(device)` when it reaches a layer of
        `device` (after the earlier layers ran), as a CUDA error there would."""
        self._check_device(device, lost=False)
        self.placed.inject_fault(device, reason)

    def _check_device(self, device: int, lost: bool) -> None:
        n = len(self.placed.home.devices)
        if not 0 <= device < n:
            raise ConfigError(f"there is no device {device}; this server has devices 0-{n - 1}")
        if lost and device not in self.placed.lost:
            raise ConfigError(f"device {device} is not lost; nothing to restore")
        if not lost and device in self.placed.lost:
            raise ConfigError(f"device {device} is already lost")
        if not lost and self.placed.placement.used() == [device]:
            raise DeviceLost(device, LAST_DEVICE)

    def _request(self, op: str, device: int, reason: str) -> concurrent.futures.Future[Any]:
        self._check_device(device, lost=op == "restore")
        fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        sched = self.scheduler
        if sched is None:
            with self._lock:
                self._apply(None, op, device, reason, time.perf_counter())
            fut.set_result(self.status())
            return fut
        with sched.locked():
            self._requests.append((op, device, reason, fut))
            sched.wakeup()
        return fut

    # ---- the scheduler's thread ----------------------------------------------------------------

    def poll(self, sched: SchedulerPort) -> None:
        """Apply the queued requests (called by the scheduler between steps)."""
        if not self._requests:
            return
        with sched.locked():
            todo, self._requests = self._requests, []
        for op, device, reason, fut in todo:
            try:
                with self._lock:
                    self._apply(sched, op, device, reason, time.perf_counter())
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(self.status())

    def lost_in_step(self, sched: SchedulerPort, exc: BaseException, items: list[Any]) -> bool:
        """A forward failed: when a device is lost, fail over and requeue the step's sequences
        (True); any other error is the step's own (False: the caller fails its requests)."""
        device, reason = self._which(exc)
        if device is None:
            return False
        if self.placed.placement.used() == [device]:
            self._set(FAILED, f"device {device} lost ({reason}): {LAST_DEVICE}")
            log.error("the last device (%d) is lost (%s); restart the server", device, reason)
            return False
        log.error("device %d lost during a forward (%s); failing over", device, reason)
        seen = time.perf_counter()
        try:
            with self._lock:
                self._apply(sched, "fail", device, reason, seen)
        except BaseException:
            log.exception("failover from device %d failed", device)
            return False
        return True

    def _which(self, exc: BaseException) -> tuple[int | None, str]:
        if isinstance(exc, DeviceLost):
            return exc.device, exc.reason
        if isinstance(exc, KvtierError) or not isinstance(exc, RuntimeError):
            return None, ""
        placement = self.placed.placement
        for d in placement.used():
            why = probe(placement.devices[d])
            if why is not None:
                return d, f"{type(exc).__name__} in a forward; probe: {why}"
        return None, ""

    def _apply(
        self, sched: SchedulerPort | None, op: str, device: int, reason: str, since: float
    ) -> None:
        self.placed.make_primary_current()
        if op == "fail" and device in self.placed.lost:
            return
        try:
            if op == "fail":
                self._fail_over(sched, device, reason, since)
            else:
                self._bring_back(sched, device)
        except BaseException as exc:
            if self.state in (DRAINING, RESTORING):  # half moved, no page pool: cannot serve
                why = exc.reason if isinstance(exc, DeviceLost) else f"{type(exc).__name__}: {exc}"
                what = "failover from" if op == "fail" else "restore of"
                self._set(FAILED, f"{what} device {device} failed ({why}); restart the server")
            raise

    def _fail_over(
        self, sched: SchedulerPort | None, device: int, reason: str, since: float
    ) -> None:
        self._set(DRAINING, f"device {device} lost: {reason}")
        moves = device == self.placed.placement.primary
        self._re_place(sched, moves, lambda: self.placed.replace(device), lost=True)
        self.failovers += 1
        self.last_failover_s = time.perf_counter() - since
        survivors = ", ".join(str(d) for d in self.placed.placement.used())
        self._set(
            DEGRADED,
            f"device {device} lost ({reason}); its layers run on device(s) {survivors}",
        )
        log.warning("degraded: %s (failover took %.3f s)", self.reason, self.last_failover_s)

    def _bring_back(self, sched: SchedulerPort | None, device: int) -> None:
        self._set(RESTORING, f"device {device} returning")
        primary = self.placed.placement.primary
        moves = self.placed.home.primary == device and primary != device
        # a running sequence keeps its pages unless L1 moves (its K/V would go too)
        self._re_place(sched, moves, lambda: self.placed.restore(device), keep_pages=not moves)
        if self.placed.lost:
            lost = ", ".join(str(d) for d in sorted(self.placed.lost))
            self._set(DEGRADED, f"device(s) {lost} still lost")
        else:
            self._set(HEALTHY, "")
        log.warning("device %d restored: %s", device, self.placed.placement.describe())

    def _re_place(
        self,
        sched: SchedulerPort | None,
        moves: bool,
        change: Callable[[], object],
        lost: bool = False,
        keep_pages: bool = False,
    ) -> None:
        """Drain and drop the pool, `change` the placement, rebuild the pool; when the primary
        device `moves`, the session L1 and the batch's buffers move with it (rehome.py; `lost`:
        from a lost device, whose L1 is not read)."""
        old = self._drop(sched, keep_pages=keep_pages)
        if moves:
            rehome.quiesce(sched)
        change()
        if moves:
            rehome.rehome(self, sched, lost=lost)
        self._build(sched, old)

    def _drop(self, sched: SchedulerPort | None, keep_pages: bool) -> _PoolShape | None:
        """Drain, then let go of the page pool and the runner (their memory is freed before the
        layers move). Every running sequence leaves the pool and waits at the head of the
        queue, in its order. With `keep_pages` its K/V first moves to its session's Cache (the
        scheduler's preemption); without, its pages are dropped unread and the tokens they held
        are recomputed when it is admitted again."""
        if sched is None:
            return None
        sched.evacuate(keep=keep_pages)
        pool = sched.detach_pool()
        shape = _PoolShape(pool.geometry, pool.page_size, pool.dtype, pool.native_page_bytes)
        self.home_budget = self.home_budget or pool.num_pages * pool.page_bytes
        del pool
        if any(d.type == "cuda" for d in self.placed.home.devices):
            try:
                torch.cuda.empty_cache()
            except Exception as exc:  # a lost device may fail to give its blocks back
                log.warning("emptying the CUDA cache failed (%s); going on", exc)
        return shape

    def _build(self, sched: SchedulerPort | None, shape: _PoolShape | None) -> None:
        """A new page pool and runner for the current placement."""
        if sched is None or shape is None:
            return
        self.placed.make_primary_current()
        placement = self.placed.placement
        pool = ShardedPagePool(
            shape.geometry,
            self._budget(shape.page_bytes, placement),
            placement,
            page_size=shape.page_size,
            dtype=shape.dtype,
            kv_dtype=pool_kv(sched.config, bool(self.placed.lost)),  # int8 while degraded
        )
        runner = BatchRunner(
            self.placed.model,
            pool,
            max_batch=sched.max_batch,
            max_tokens=sched.batch_tokens,
            max_seq_len=sched.served.context_tokens,
        )
        sched.install_pool(pool, runner)
        log.info(
            "page pool rebuilt: %d pages of %d tokens (%s K/V) on %s",
            pool.num_pages,
            pool.page_size,
            pool.kv_dtype,
            placement.describe(),
        )

    def _budget(self, page_bytes: int, placement: Placement) -> int:
        """Pool bytes for `placement`: no device holds more pool bytes than it did at home (and
        no more than 80% of a GPU's free memory), so a survivor's pages cover fewer tokens."""
        home = self.placed.home
        total = self.home_budget
        n = len(home.layers)
        pages = total // page_bytes
        for d in placement.used():
            now = len(placement.layers_on(d))
            per_page = page_bytes * now // n
            allowed = total * len(home.layers_on(d)) // n
            dev = placement.devices[d]
            if dev.type == "cuda":
                free, _ = torch.cuda.mem_get_info(dev)
                allowed = min(allowed, int(free * 0.8))
            pages = min(pages, allowed // max(1, per_page))
        if pages < 1:
            raise DeviceLost(
                min(self.placed.lost or {0}),
                "the surviving devices have no room for one KV page; restart the server",
            )
        return int(pages * page_bytes)

    # ---- state ---------------------------------------------------------------------------------

    def _set(self, state: str, reason: str) -> None:
        self.state = state
        self.reason = reason
        self.history.append(state)
        self._report()

    def _report(self) -> None:
        if self.metrics is not None and hasattr(self.metrics, "devices"):
            lost = len(self.placed.lost)
            ok = len(self.placed.home.used()) - lost
            self.metrics.devices(ok, lost, self.state, self.last_failover_s)

    @property
    def degraded(self) -> bool:
        return self.state != HEALTHY

    def status(self) -> dict[str, Any]:
        placement = self.placed.placement
        devices = []
        for d, dev in enumerate(placement.devices):
            devices.append(
                {
                    "index": d,
                    "device": str(dev),
                    "state": "lost" if d in self.placed.lost else "ok",
                    "layers": placement.layers_on(d),
                    "home_layers": self.placed.home.layers_on(d),
                }
            )
        return {
            "state": self.state,
            "reason": self.reason,
            "devices": devices,
            "failovers": self.failovers,
            "last_failover_seconds": self.last_failover_s,
        }


class NvmlWatch:
    """Polls NVML for the placed GPUs; a GPU NVML reports gone is failed over (`fail`)."""

    def __init__(self, failover: DeviceFailover, interval_s: float = 2.0) -> None:
        self.failover = failover
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._handles: dict[int, Any] = {}
        try:
            import pynvml

            pynvml.nvmlInit()
            for d, dev in enumerate(failover.placed.home.devices):
                if dev.type == "cuda":
                    uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
                    if uuid is None:
                        raise RuntimeError("this torch does not report GPU UUIDs")
                    self._handles[d] = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except Exception as exc:  # no NVML: CUDA errors and injected faults still fail over
            log.info("NVML device watch off: %s", exc)
            self._handles = {}
        self._thread = threading.Thread(target=self._run, name="kvtier-nvml", daemon=True)
        if self._handles:
            self._thread.start()

    def _run(self) -> None:
        import pynvml

        while not self._stop.wait(self.interval_s):
            for d, handle in self._handles.items():
                if d in self.failover.placed.lost:
                    continue
                try:
                    pynvml.nvmlDeviceGetPciInfo(handle)
                except pynvml.NVMLError as exc:
                    if getattr(exc, "value", None) == getattr(pynvml, "NVML_ERROR_GPU_IS_LOST", -1):
                        log.error("NVML reports device %d gone: %s", d, exc)
                        try:
                            self.failover.fail(d, f"NVML: {exc}")
                        except KvtierError:
                            pass

    def close(self) -> None:
        self._stop.set()


def place(served: Any, devices: list[torch.device], metrics: Any = None) -> Any:
    """Spread `served`'s decoder layers over `devices` (balanced contiguous ranges) and give
    it a `DeviceFailover`; returns `served`. One device or none: `served` unchanged."""
    if len(devices) < 2:
        return served
    layers = len(decoder_layers(served.model))
    placed = PlacedModel(served.model, Placement.balanced(layers, devices))
    failover = DeviceFailover(placed, metrics)
    failover.served = served
    if served.allowed is not None:
        failover.allowed = served.allowed.to("cpu", copy=True)  # the lost primary's is unread
        served.allowed = served.allowed.to(placed.primary_device)
    served.devices = failover
    log.info("model placed: %s", placed.placement.describe())
    return served


def place_configured(served: Any, config: ServerConfig, metrics: Any = None) -> Any:
    """`place` over the configured devices (`devices`, or KVTIER_DEVICES); with GPUs, NVML
    is watched for a device that disappears."""
    devices = parse_devices(devices_setting(config.devices))
    if len(devices) < 2:
        return served
    if not config.batching:
        raise ConfigError(
            "devices: a model across devices runs through the batch scheduler; turn batching "
            "on (--batching true) or name one device"
        )
    served = place(served, devices, metrics)
    if any(d.type == "cuda" for d in devices):
        served.devices.watch = NvmlWatch(served.devices)
    return served
