"""Data-parallel replicas: one engine per device, sharing the host tiers.

With `replicas` set (`--replicas 0,1`, `auto`, or `cpu,cpu` for the fake two-device layout the
CPU tests run on) the server runs one `Engine` per device, each with its own copy of the model,
its own page pool and its own batch scheduler, so the devices step their batches at once. They
share one cache (`TieredBackend`): one L2 arena, one L3 store (and L4 where configured), one
session table. A turn's K/V committed by one replica (paged L1 stores every chunk of a finished
turn in L2, its partial tail too) restores on any other.

`ReplicaSet` is what the routes see as the engine. It picks each turn's replica:

- *affinity*: a session's turns go to the replica that served it last (its parked pages are
  there: the next turn starts from them, no copy); while one of its requests is queued or
  running on a replica, the next goes there too, behind it (per-session order);
- a new session goes to the least loaded replica (running and waiting turns, then the
  sessions homed there);
- a session *moves* when its replica is lost, or full (every batch slot busy) while another
  has a free slot: its parked pages on the old replica are dropped and it restores from L2/L3
  on the new one, exactly (`move` does the same on request).

Losing a replica's device (a CUDA error that loses its context, `Engine.device_fault`, or an
injected fault: `inject_fault`, `fail`) takes that replica out; the server keeps serving on the
others and only losing every replica stops it. A turn the lost replica had not started
streaming runs again on a survivor; one it was streaming fails (the client retries). No
session is lost: each continues on a survivor from what L2/L3 hold. Where the lost device held
the cache's device side (its staging buffers and L1: the first replica's device), that moves to
a survivor first (`TieredCache.move_l1`).

This is the layout for a model that fits one device; a model larger than one device is placed
across devices by layers (`devices`, kvtier.server.devices.failover) instead.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import threading
from collections import Counter
from typing import Any

import torch

from kvtier.errors import ConfigError, KvtierError
from kvtier.placement import parse_devices
from kvtier.server.backend import Backend, make_backend
from kvtier.server.batch.engine import Engine
from kvtier.server.batch.jobs import Draining, Job, Stream
from kvtier.server.config import ServerConfig
from kvtier.server.devices.devicefault import DeviceFault
from kvtier.server.devices.memplan import build_plan, planned_config
from kvtier.server.devices.model import ServedModel

log = logging.getLogger("kvtier.server")

INJECTED = "CUDA error: device lost (fault injected)"  # what an injected fault raises


def replica_devices(config: ServerConfig) -> list[torch.device]:
    """The devices of the `replicas` setting; [] where it names fewer than two (one engine)."""
    spec = config.replicas
    try:
        devices = parse_devices(spec)
    except ConfigError as exc:  # parse_devices speaks of `devices`
        raise ConfigError(str(exc).replace("devices", "replicas", 1)) from None
    if config.devices.strip() and devices:
        raise ConfigError("replicas and devices are two layouts of the model; give one")
    return devices if len(devices) > 1 else []


def clone_served(served: ServedModel, device: torch.device) -> ServedModel:
    """`served` with a copy of its model on `device`: the same architecture built there, then
    every weight copied from the original (device to device), so greedy replies are the same."""
    from transformers import AutoModelForCausalLM

    src = served.model
    dtype = next(src.parameters()).dtype
    with torch.device(device):  # a config of its own: a batch runner switches its attention
        model: Any = AutoModelForCausalLM.from_config(copy.deepcopy(src.config), dtype=dtype)
    with torch.no_grad():
        model.load_state_dict(src.state_dict())
        mine = dict(model.named_buffers())
        for name, buf in src.named_buffers():  # non-persistent ones too (rotary tables)
            if name in mine and mine[name].shape == buf.shape:
                mine[name].copy_(buf)
    allowed = served.allowed.to(device) if served.allowed is not None else None
    return dataclasses.replace(served, model=model.eval(), allowed=allowed, devices=None)


class ReplicaSet(Engine):
    """One engine per device behind the `Engine` face the routes use (see the module
    docstring). `engines[i]` is replica i; they share `backend`."""

    def __init__(
        self,
        engines: list[Engine],
        metrics: Any = None,
        on_fatal: Any = None,
    ) -> None:
        if len(engines) < 2:
            raise ConfigError("replicas: name at least two devices")
        self.engines = engines
        first = engines[0]
        super().__init__(first.served, first.backend, first.config, metrics, first.plan, on_fatal)
        self.lost: dict[int, str] = {}
        self.moves = 0  # sessions moved to another replica
        self.retried = 0  # turns run again on a survivor after their replica was lost
        self._home: dict[tuple[str, str], int] = {}  # (tenant, session) -> its replica
        self._homed: Counter[int] = Counter()
        self._replica_lock = threading.Lock()
        self._faults: set[int] = set()
        self._hooks: list[Any] = []  # the fault injection's forward pre-hooks (`inject_fault`)
        for i, e in enumerate(engines):
            e.on_fatal = functools.partial(self._lost, i)
            hook = e.served.model.register_forward_pre_hook(functools.partial(self._hook, i))
            self._hooks.append(hook)

    # ---- the Engine face ------------------------------------------------------------------------

    @property  # type: ignore[override]
    def running(self) -> int:
        return sum(e.running for e in getattr(self, "engines", []))

    @running.setter
    def running(self, value: int) -> None:  # the base class's counter: the replicas keep theirs
        pass

    @property  # type: ignore[override]
    def waiting(self) -> int:
        return sum(e.waiting for e in getattr(self, "engines", []))

    @waiting.setter
    def waiting(self, value: int) -> None:
        pass

    async def start(self, job: Job) -> Stream:
        """Run `job` on its replica (see `pick`); a replica lost before the turn started
        streaming hands it to a survivor."""
        if self.draining:
            raise Draining("the server is shutting down; retry on another replica or later")
        for _ in range(len(self.engines)):
            i = self.pick(job.session_id, job.tenant)
            engine = self.engines[i]
            try:
                return await engine.start(job)
            except BaseException as exc:
                if engine.fatal is None:
                    raise
                self.retried += 1
                log.warning("replica %d is lost (%s); session %s runs on another", i,
                            type(exc).__name__, job.session_id[:64])  # fmt: skip
        raise Draining(f"{self.fatal or 'every replica is lost'}; retry later")

    def pick(self, session_id: str, tenant: str) -> int:
        """The replica of a session's next turn: where one of its requests is queued or running;
        else its home unless lost, or full while another has a free slot; else the least loaded
        (the session moves there)."""
        alive = self.alive()
        if not alive:
            raise Draining(f"{self.fatal or 'every replica is lost'}; retry later")
        for i in alive:
            if self.engines[i].busy(session_id, tenant):
                return i
        key = (tenant, session_id)
        home = self._home.get(key)
        best = min(alive, key=lambda i: (self.load(i), self._homed[i], i))
        if home in alive and not (self.full(home) and not self.full(best)):
            return home
        self._set_home(key, best)
        if home is not None and home != best:
            self.moves += 1
            if home in alive:  # its parked pages there are no longer its L1
                self.engines[home].drop_pages(session_id, tenant)
        return best

    def move(self, session_id: str, tenant: str, replica: int) -> None:
        """Send the session's next turns to `replica` (it restores from L2/L3 there)."""
        if replica not in self.alive():
            raise ConfigError(f"replica {replica} is not serving (replicas: {self.alive()})")
        key = (tenant, session_id)
        home = self._home.get(key)
        if home == replica:
            return
        self._set_home(key, replica)
        self.moves += 1
        if home is not None and home not in self.lost:
            self.engines[home].drop_pages(session_id, tenant)

    def home_of(self, session_id: str, tenant: str) -> int | None:
        """The replica the session's next turn goes to, None for a session not seen yet."""
        return self._home.get((tenant, session_id))

    def alive(self) -> list[int]:
        return [i for i, e in enumerate(self.engines) if i not in self.lost and e.fatal is None]

    def load(self, replica: int) -> int:
        e = self.engines[replica]
        return e.running + e.waiting

    def full(self, replica: int) -> bool:
        e = self.engines[replica]
        return e.running >= int(e.config.max_concurrency)

    def _set_home(self, key: tuple[str, str], replica: int) -> None:
        old = self._home.get(key)
        if old is not None:
            self._homed[old] -= 1
        self._home[key] = replica
        self._homed[replica] += 1

    def drop_pages(self, session_id: str, tenant: str) -> None:
        """The cache forgot the session (each replica drops its own pages): no home either."""
        old = self._home.pop((tenant, session_id), None)
        if old is not None:
            self._homed[old] -= 1

    async def session_admin(self, session_id: str, tenants: list[str], op: str) -> bool:
        """As `Engine.session_admin`, on the replica each session's requests run on (its
        session lock is that replica's)."""
        found = False
        for name in tenants:
            i = self._home.get((name, session_id))
            alive = self.alive()
            engine = self.engines[i if i in alive else (alive or [0])[0]]
            found |= await engine.session_admin(session_id, [name], op)
            if op in ("hibernate", "forget"):
                for e in self.engines:
                    e.drop_pages(session_id, name)
        return found

    async def drain(self, close_backend: bool = True) -> None:
        """Every replica drains (running turns finish), then the shared cache closes."""
        self.draining = True
        for e in self.engines:
            e.draining = True
        await asyncio.gather(*(e.drain(close_backend=False) for e in self.engines))
        for hook in self._hooks:
            hook.remove()
        await asyncio.to_thread(self._pool.shutdown, True)
        if close_backend:
            await asyncio.to_thread(self.backend.close)

    def warm_up(self, *args: Any, **kwargs: Any) -> None:
        """Each replica's warm-up (its kernels, graphs, the cache's paths), one after another."""
        for e in self.engines:
            e.warm_up(*args, **kwargs)
        self.plan = self.engines[0].plan
        self.peaks = self.engines[0].peaks

    def device_fault(self, exc: BaseException) -> bool:
        """Whether every replica is lost (the server stops); a replica's own faults reach
        `_lost` through its engine."""
        return self.fatal is not None

    # ---- losing a replica -----------------------------------------------------------------------

    def inject_fault(self, replica: int) -> None:
        """Test hook: from now on every forward on `replica` raises a device error that loses
        its context, as a lost GPU's would (the replica is taken out at the first)."""
        if not 0 <= replica < len(self.engines):
            raise ConfigError(f"there is no replica {replica} (0-{len(self.engines) - 1})")
        self._faults.add(replica)

    def fail(self, replica: int, reason: str = "fault injected") -> None:
        """Take `replica` out now, as a lost device (its running turns fail at their next
        step; queued ones and later turns go to the survivors)."""
        self.inject_fault(replica)
        if replica not in self.lost:
            self.engines[replica].device_fault(RuntimeError(f"{INJECTED}: {reason}"))

    def _hook(self, replica: int, module: Any, args: Any) -> None:
        if replica in self._faults:
            raise RuntimeError(f"{INJECTED} on replica {replica}")

    def _lost(self, replica: int, fault: BaseException) -> None:
        """Replica `replica`'s engine lost its device (`Engine.on_fatal`): serve on the rest."""
        with self._replica_lock:
            if replica in self.lost:
                return
            self.lost[replica] = str(fault)
            alive = self.alive()
            log.error("replica %d is lost (%s); %d replica(s) serve on", replica, fault,
                      len(alive))  # fmt: skip
            if not alive:
                self.fatal = fault if isinstance(fault, DeviceFault) else DeviceFault.of(fault)
            else:
                self._rehome_cache(replica, alive[0])
        if self.fatal is not None and self.on_fatal is not None:
            self.on_fatal(self.fatal)

    def _rehome_cache(self, lost: int, survivor: int) -> None:
        """The cache's device side (L1, staging buffers) lived on the lost replica's GPU: it
        moves to the survivor's, dropping what only it held (L2/L3 hold every committed chunk)."""
        cache = getattr(self.backend, "cache", None)
        old = self.engines[lost].served.device
        if cache is None or old.type != "cuda" or cache.device != old:
            return
        try:
            cache.move_l1(self.engines[survivor].served.device, lost=True)
        except KvtierError as exc:
            log.error("moving the cache's device side off replica %d failed: %s", lost, exc)

    def status(self) -> dict[str, Any]:
        """Each replica's device, state and load, and the sessions moved and retried."""
        return {
            "replicas": [
                {
                    "index": i,
                    "device": str(e.served.device),
                    "state": "lost" if i in self.lost else "ok",
                    "reason": self.lost.get(i, ""),
                    "running": e.running,
                    "waiting": e.waiting,
                    "sessions": self._homed[i],
                }
                for i, e in enumerate(self.engines)
            ],
            "moves": self.moves,
            "retried": self.retried,
        }


def build_replicas(
    served: ServedModel,
    config: ServerConfig,
    metrics: Any = None,
    on_fatal: Any = None,
    backend: Backend | None = None,
) -> ReplicaSet:
    """The replicas of `config.replicas`: `served` (loaded on the first device) and a copy on
    each other device, each with its GPU memory plan, sharing one cache (`backend`, else made
    from the first replica's settings)."""
    devices = replica_devices(config)
    if not devices:
        raise ConfigError("replicas: name at least two devices (auto, 0,1 or cpu,cpu)")
    if served.devices is not None:
        raise ConfigError("replicas: the model is placed across devices already (devices)")
    if served.device != devices[0]:
        raise ConfigError(f"replicas: the model is on {served.device}, not {devices[0]}")
    serveds = [served] + [clone_served(served, d) for d in devices[1:]]
    setups = []
    for s in serveds:
        run = config.for_device(s.device.type)
        plan = build_plan(s, run)
        setups.append((s, planned_config(run, plan), plan))
    if backend is None:
        backend = make_backend(serveds[0], setups[0][1])
    engines = [Engine(s, backend, run, metrics, plan=plan) for s, run, plan in setups]
    log.info("replicas: %s", ", ".join(str(s.device) for s in serveds))
    return ReplicaSet(engines, metrics, on_fatal)
