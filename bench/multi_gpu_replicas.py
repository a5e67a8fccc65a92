"""The replicas section of `bench/multi_gpu.py` (`--layout replicas` or `both`).

Data-parallel replicas (kvtier.server.batch.replicas): one engine per device, each with its own copy
of the model, page pool and batch scheduler, sharing one tiered cache (L2/L3). Measured, through
the server's engines (restores, commits, the batch, greedy turns):

1. *throughput*: the batched fleet's tokens/s (generated tokens over the fleet's wall time) on
   one device with N sessions, and on two replicas with 2N sessions; the ratio (target 1.8x)
   and the turns that ran out of device memory (target 0);
2. *failover*: 2N sessions' second turns on the two replicas; mid-turn, replica 0 (the first
   device: it also holds the cache's device side) is lost. A turn that fails there is sent
   again at once, as a client would; it runs on the survivor from what L2/L3 hold. Measured:
   fault to the first token served again, sessions lost (a turn that fails on the survivor
   too), and whether the turns' tokens and the next turns' equal a run without the fault.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import torch

from kvtier.server.backend import TieredBackend
from kvtier.server.batch.engine import Engine
from kvtier.server.batch.jobs import Delta, Finished, Job
from kvtier.server.batch.replicas import ReplicaSet, build_replicas
from kvtier.server.devices.memplan import build_plan, planned_config
from kvtier.server.devices.model import ServedModel


@dataclasses.dataclass
class Turn:
    text: str = ""
    end: str = "none"  # the finish reason, or the error
    tokens: int = 0
    cached: int = 0
    first_token: float = float("nan")  # perf_counter() of its first delta


def _oom(end: str) -> bool:
    return "OutOfMemoryError" in end or "out of memory" in end


async def turn(engine: Engine, sid: str, prompt: list[int], tokens: int, on: Any = None) -> Turn:
    """One greedy turn through `engine` (one engine or the replicas)."""
    out = Turn()
    try:
        stream = await engine.start(Job(sid, "bench", tuple(prompt), tokens, temperature=0.0))
        async for event in stream.events():
            if isinstance(event, Delta):
                if not out.text:
                    out.first_token = time.perf_counter()
                out.text += event.text
                if on is not None:
                    on(sid, out.text)
            elif isinstance(event, Finished):
                out.end, out.tokens, out.cached = (
                    event.finish_reason,
                    event.completion_tokens,
                    event.cached_tokens,
                )
    except Exception as exc:  # a failed turn (its replica lost, out of memory)
        out.end = f"{type(exc).__name__}: {exc}"
    return out


async def fleet(
    engine: Engine, jobs: list[tuple[str, list[int]]], tokens: int, on: Any = None
) -> tuple[list[Turn], float]:
    """Every job at once; the turns and the wall time, once every slot is given back."""
    t0 = time.perf_counter()
    turns = list(await asyncio.gather(*[turn(engine, s, p, tokens, on) for s, p in jobs]))
    wall = time.perf_counter() - t0
    while engine.running:
        await asyncio.sleep(0.01)
    return turns, wall


def one_engine(served: ServedModel, cfg: Any) -> Engine:
    """The server's engine on one device (its memory plan, the tiered cache)."""
    run = planned_config(cfg, build_plan(served, cfg))
    return Engine(served, TieredBackend(served.model, run, served.name), run)


def _warm(engine: Engine, prompts: list[list[int]]) -> None:
    engine.warm_up()

    async def main() -> None:
        await fleet(engine, [(f"w{i}", p) for i, p in enumerate(prompts)], 4)

    asyncio.run(main())


def replicas_of(served: ServedModel, devices: list[torch.device], cfg: Any) -> ReplicaSet:
    """Two replicas of `served` (a model a batch ran before is given back its own attention
    first: the engines' warm-ups run it outside the batch, and the copy takes its setting)."""
    served.model.set_attn_implementation("sdpa")
    spec = ",".join(str(d.index) if d.type == "cuda" else d.type for d in devices)
    return build_replicas(served, dataclasses.replace(cfg, replicas=spec))


def throughput(
    served: ServedModel, devices: list[torch.device], cfg: Any, jobs: list[list[int]], tokens: int
) -> dict[str, Any]:
    """N sessions on one device, then 2N on two replicas (the same prompts twice)."""
    n = len(jobs)
    res: dict[str, Any] = {"sessions_1": n, "sessions_2": 2 * n}
    one = one_engine(served, cfg)
    _warm(one, jobs[:2])
    turns1, wall1 = asyncio.run(fleet(one, [(f"a{i}", p) for i, p in enumerate(jobs)], tokens))
    asyncio.run(one.drain())
    two = replicas_of(served, devices, cfg)
    _warm(two, jobs[:2])
    both = [(f"{k}{i}", p) for k in "bc" for i, p in enumerate(jobs)]
    turns2, wall2 = asyncio.run(fleet(two, both, tokens))
    res["per_replica_sessions"] = [r["sessions"] for r in two.status()["replicas"]]
    asyncio.run(two.drain())
    res["tok_s_1"] = sum(t.tokens for t in turns1) / wall1
    res["tok_s_2"] = sum(t.tokens for t in turns2) / wall2
    res["ratio"] = res["tok_s_2"] / res["tok_s_1"]
    res["oom"] = sum(_oom(t.end) for t in turns1 + turns2)
    res["failed"] = sum(t.end not in ("length", "stop") for t in turns1 + turns2)
    texts1 = [t.text for t in turns1]
    res["equal"] = sum(a == b.text for a, b in zip(texts1 + texts1, turns2, strict=True))
    return res


def failover(
    served: ServedModel, devices: list[torch.device], cfg: Any, jobs: list[list[int]], tokens: int
) -> dict[str, Any]:
    """2N sessions (R: the reference, F: the same conversations) on two replicas; replica 0 is
    lost in the middle of the F sessions' second turns."""
    rs = replicas_of(served, devices, cfg)
    n = len(jobs)
    marks: dict[str, float] = {}

    def on_token(sid: str, text: str) -> None:
        if "fault" not in marks and len(text) >= max(1, tokens // 4) and 0 not in rs.lost:
            marks["fault"] = time.perf_counter()
            rs.inject_fault(0)

    async def run() -> dict[str, Any]:
        t1, _ = await fleet(rs, [(f"{k}{i}", p) for k in "RF" for i, p in enumerate(jobs)], tokens)
        second = [
            p + list(t.text.encode()) + [10] + list(b"go on")
            for p, t in zip(jobs, t1[:n], strict=True)
        ]
        ref2, _ = await fleet(rs, [(f"R{i}", p) for i, p in enumerate(second)], tokens)
        # the F sessions homed on replica 0 are the ones the fault hits
        on0 = [i for i in range(n) if rs.home_of(f"F{i}", "bench") == 0]
        got2, _ = await fleet(rs, [(f"F{i}", p) for i, p in enumerate(second)], tokens, on_token)
        failed = [i for i, t in enumerate(got2) if t.end not in ("length", "stop")]
        # the client's retry: at once, on the survivor, from L2/L3
        again, _ = await fleet(rs, [(f"F{i}", second[i]) for i in failed], tokens)
        for i, t in zip(failed, again, strict=True):
            got2[i] = t
        # their first token after the fault: of the retry, or of the turn handed over
        fault = marks.get("fault", float("nan"))
        served_again = [got2[i].first_token for i in on0 if got2[i].first_token > fault]
        lost = sum(t.end not in ("length", "stop") for t in got2)
        third = [p + list(t.text.encode()) + [10] for p, t in zip(second, ref2, strict=True)]
        t3, _ = await fleet(rs, [(f"{k}{i}", p) for k in "RF" for i, p in enumerate(third)], tokens)
        lost += sum(t.end not in ("length", "stop") for t in t3[n:])
        return {
            "sessions": n,
            "on_lost_replica": len(on0),
            "failed_mid_turn": len(failed),
            "retried_before_streaming": rs.retried,
            "fault_to_token_s": min(served_again, default=float("nan")) - fault,
            "sessions_lost": lost,
            "resumed_equal": sum(a.text == b.text for a, b in zip(got2, ref2, strict=True)),
            "next_turn_equal": sum(t3[i].text == t3[n + i].text for i in range(n)),
            "restored_from_tiers": sum(t.cached > 0 for t in t3[n:]),
            "oom": sum(_oom(t.end) for t in t1 + ref2 + got2 + t3),
            "lost_replicas": sorted(rs.lost),
        }

    try:
        return asyncio.run(run())
    finally:
        asyncio.run(rs.drain())


def report(r: dict[str, Any]) -> None:
    t, fo = r["throughput"], r["failover"]
    print(
        f"\nreplicas: one engine per device, sharing L2/L3 ({t['sessions_1']} sessions per device)"
    )
    print(f"{'metric':40} {'1 device':>12} {'2 replicas':>12} {'ratio':>7}  target")
    print(
        f"{'fleet tok/s (generated / wall)':40} {t['tok_s_1']:12.1f} {t['tok_s_2']:12.1f} "
        f"{t['ratio']:6.2f}x  >= 1.8x"
    )
    print(f"{'sessions':40} {t['sessions_1']:12d} {t['sessions_2']:12d}")
    print(
        f"{'sessions homed per replica (+ warm-up)':40} {'':12} {t['per_replica_sessions']!s:>12}"
    )
    print(f"{'turns out of memory':40} {t['oom']:12d} {'':12} {'':7}  0")
    print(f"{'replies equal, 2 replicas vs 1':40} {'':12} {t['equal']:>9}/{t['sessions_2']}")
    n = fo["sessions"]
    print(f"\nreplica 0 lost mid-turn ({n} sessions turning, {fo['on_lost_replica']} on it):")
    print(f"  fault -> first token served again   {fo['fault_to_token_s']:8.3f} s   (target < 1 s)")
    print(f"  sessions lost                       {fo['sessions_lost']:8d}     (target 0)")
    print(f"  turns failed mid-stream, retried    {fo['failed_mid_turn']:8d}")
    print(f"  turns handed over before streaming  {fo['retried_before_streaming']:8d}")
    print(f"  turns equal to no-fault run         {fo['resumed_equal']:5d}/{n}")
    print(f"  next turns equal                    {fo['next_turn_equal']:5d}/{n}")
    print(f"  next turns restored from L2/L3      {fo['restored_from_tiers']:5d}/{n}")
    print(f"  turns out of memory                 {fo['oom']:8d}")
