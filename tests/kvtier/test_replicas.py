"""Data-parallel replicas on a fake two-device layout (two logical CPU devices, float32).

Two engines, each with its own copy of a tiny random model, page pool and batch scheduler,
share one tiered cache (L2/L3). Every reply is compared with the greedy reply of the same model
alone (transformers' DynamicCache); which replica ran a turn is read from forward hooks on each
replica's model. A lost replica is a device fault injected into its forwards: from then on
every forward there raises, as on a lost GPU.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from test_batching import _build, _config, _greedy_alone, _job, _prompts

from kvtier.errors import ConfigError
from kvtier.server.batch.jobs import Delta, Finished, Started
from kvtier.server.batch.replicas import ReplicaSet, build_replicas, clone_served, replica_devices
from kvtier.server.config import ServerConfig

CPU = torch.device("cpu")


class Turn:
    """One turn's outcome: its text, Started and Finished events, or its error."""

    def __init__(self) -> None:
        self.text = ""
        self.started: Started | None = None
        self.finished: Finished | None = None
        self.error: BaseException | None = None


async def _turn(rs: ReplicaSet, job: Any, on_delta: Any = None) -> Turn:
    out = Turn()
    try:
        stream = await rs.start(job)
        out.started = stream.started
        async for event in stream.events():
            if isinstance(event, Delta):
                out.text += event.text
                if on_delta is not None:
                    on_delta(out.text)
            elif isinstance(event, Finished):
                out.finished = event
    except Exception as exc:  # a turn on a lost replica fails; the test says which may
        out.error = exc
    return out


def _replicas(tmp_path: Path, **over: Any) -> tuple[ReplicaSet, list[list[int]]]:
    """Two replicas of the tiny Llama; `calls[i]` counts replica i's forwards (one list per
    replica, a 1 appended per forward)."""
    config = _config(tmp_path, replicas="cpu,cpu", **over)
    rs = build_replicas(_build("llama"), config)
    calls: list[list[int]] = [[] for _ in rs.engines]
    for i, e in enumerate(rs.engines):
        e.served.model.register_forward_pre_hook(lambda m, a, c=calls[i]: c.append(1))
    return rs, calls


def _run(rs: ReplicaSet, *calls: Any) -> list[Turn]:
    async def main() -> list[Turn]:
        turns = list(await asyncio.gather(*calls))
        while rs.running:  # each turn's slot is given back on this loop, after its Finished
            await asyncio.sleep(0.01)
        return turns

    return asyncio.run(asyncio.wait_for(main(), 120))


async def _close(rs: ReplicaSet) -> None:
    await rs.drain()


def _next(prompt: list[int], text: str, *more: int) -> list[int]:
    return prompt + list(text.encode()) + list(more or (10, 65, 66))


def test_replica_devices_and_settings(tmp_path: Path) -> None:
    assert replica_devices(ServerConfig(replicas="cpu,cpu")) == [CPU, CPU]
    assert replica_devices(ServerConfig(replicas="cpu")) == []  # one device: one engine
    assert replica_devices(ServerConfig()) == []
    with pytest.raises(ConfigError, match="replicas"):
        replica_devices(ServerConfig(replicas="gpu,gpu"))
    with pytest.raises(ConfigError, match="two layouts"):
        ServerConfig(replicas="0,1", devices="0,1")
    toml = tmp_path / "kvtier.toml"
    toml.write_text("[serve]\nreplicas = [0, 1]\n")
    assert ServerConfig.load(env={}, file=toml).replicas == "0,1"
    assert ServerConfig.load(env={"KVTIER_REPLICAS": "auto"}).replicas == "auto"
    assert ServerConfig.load(flags={"replicas": "cpu,cpu"}, env={}).replicas == "cpu,cpu"
    with pytest.raises(ConfigError, match="at least two"):
        build_replicas(_build("llama"), _config(tmp_path, replicas="cpu"))


def test_a_clone_replies_as_the_original() -> None:
    ref = _build("qwen2")
    clone = clone_served(ref, CPU)
    assert clone.model is not ref.model
    assert clone.model.config is not ref.model.config  # each replica's runner sets its own
    for (name, a), (_, b) in zip(
        ref.model.state_dict().items(), clone.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    p = _prompts(3, [40])[0]
    assert _greedy_alone(clone, p, 12) == _greedy_alone(ref, p, 12)


def test_two_replicas_serve_exactly_and_sessions_stay_on_their_replica(tmp_path: Path) -> None:
    ref = _build("llama")
    rs, calls = _replicas(tmp_path)
    prompts = _prompts(11, [5, 70, 33, 120])
    try:
        first = _run(rs, *[_turn(rs, _job(f"s{i}", p, 16)) for i, p in enumerate(prompts)])
        homes = [rs.home_of(f"s{i}", "t") for i in range(4)]
        assert sorted(homes) == [0, 0, 1, 1]  # new sessions spread over the replicas
        assert all(calls), "both replicas ran forwards"
        for turn, p in zip(first, prompts, strict=True):
            assert turn.error is None and turn.finished is not None
            assert turn.text == _greedy_alone(ref, p, 16)
        # affinity: each session's next turn runs on its replica, from its parked pages
        seconds = [_next(p, t.text) for p, t in zip(prompts, first, strict=True)]
        for i, p in enumerate(seconds):
            before = [len(c) for c in calls]
            (turn,) = _run(rs, _turn(rs, _job(f"s{i}", p, 10)))
            ran = [len(c) - b for c, b in zip(calls, before, strict=True)]
            assert ran[homes[i]] > 0 and ran[1 - homes[i]] == 0, (i, ran)
            assert rs.home_of(f"s{i}", "t") == homes[i]
            assert turn.started is not None and turn.started.source == "l1"
            assert turn.started.cached_tokens > 0
            assert turn.text == _greedy_alone(ref, p, 10)
        assert rs.moves == 0
    finally:
        asyncio.run(asyncio.wait_for(_close(rs), 60))


def test_a_session_moved_to_the_other_replica_restores_from_l2_exactly(tmp_path: Path) -> None:
    ref = _build("llama")
    rs, calls = _replicas(tmp_path)
    prompts = _prompts(5, [90, 41])
    try:
        first = _run(rs, *[_turn(rs, _job(f"m{i}", p, 20)) for i, p in enumerate(prompts)])
        for i, (p, turn) in enumerate(zip(prompts, first, strict=True)):
            assert turn.text == _greedy_alone(ref, p, 20)
            home = rs.home_of(f"m{i}", "t")
            assert home is not None
            rs.move(f"m{i}", "t", 1 - home)
            nxt = _next(p, turn.text)
            before = [len(c) for c in calls]
            (again,) = _run(rs, _turn(rs, _job(f"m{i}", nxt, 12)))
            ran = [len(c) - b for c, b in zip(calls, before, strict=True)]
            assert ran[1 - home] > 0 and ran[home] == 0, ran
            assert again.started is not None and again.started.source in ("l2", "l3")
            # its whole first turn (but the last token, never fed; the partial tail too) came
            # from L2/L3
            assert again.started.cached_tokens == len(p) + len(turn.text.encode()) - 1
            assert again.text == _greedy_alone(ref, nxt, 12)
        assert rs.moves == 2
        with pytest.raises(ConfigError, match="not serving"):
            rs.move("m0", "t", 5)
    finally:
        asyncio.run(asyncio.wait_for(_close(rs), 60))


@pytest.mark.parametrize("lost", [1, 0], ids=["replica1", "replica0-the-cache-home"])
def test_a_replica_lost_mid_run_loses_no_session(tmp_path: Path, lost: int) -> None:
    ref = _build("llama")
    rs, calls = _replicas(tmp_path)
    prompts = _prompts(23, [12, 64, 37, 101])
    sids = [f"f{i}" for i in range(len(prompts))]
    try:
        first = _run(rs, *[_turn(rs, _job(s, p, 16)) for s, p in zip(sids, prompts, strict=True)])
        homes = {s: rs.home_of(s, "t") for s in sids}
        assert sorted(homes.values()) == [0, 0, 1, 1]
        seconds = [_next(p, t.text) for p, t in zip(prompts, first, strict=True)]
        victim = next(s for s in sids if homes[s] == lost)

        def trigger(text: str) -> None:  # the device goes while its batch decodes
            if len(text) >= 4 and lost not in rs.lost:
                rs.inject_fault(lost)

        second = _run(
            rs,
            *[
                _turn(rs, _job(s, p, 24), trigger if s == victim else None)
                for s, p in zip(sids, seconds, strict=True)
            ],
        )
        assert lost in rs.lost and rs.alive() == [1 - lost] and rs.fatal is None
        for s, p, turn in zip(sids, seconds, second, strict=True):
            if homes[s] != lost:  # the survivor's turns never noticed
                assert turn.error is None and turn.text == _greedy_alone(ref, p, 24)
            elif turn.error is None:  # handed to the survivor before it streamed: exact
                assert turn.text == _greedy_alone(ref, p, 24)
            else:  # it was streaming on the lost device: that turn fails, its session stays
                assert "device lost" in str(turn.error)
        victim_turn = second[sids.index(victim)]
        assert victim_turn.error is not None, "the fault hit the victim's running turn"
        # every session's next turn (the failed ones retried) runs on the survivor, from what
        # L2/L3 hold, exactly: no session is lost
        retry = [
            p if turn.error is not None else _next(p, turn.text)
            for p, turn in zip(seconds, second, strict=True)
        ]
        before = [len(c) for c in calls]
        third = _run(rs, *[_turn(rs, _job(s, p, 12)) for s, p in zip(sids, retry, strict=True)])
        assert len(calls[lost]) == before[lost]
        for s, p, turn in zip(sids, retry, third, strict=True):
            assert turn.error is None and turn.started is not None, (s, turn.error)
            assert turn.started.cached_tokens > 0, s  # restored, not recomputed
            assert turn.text == _greedy_alone(ref, p, 12)
            assert rs.home_of(s, "t") == 1 - lost
        with pytest.raises(ConfigError, match="not serving"):
            rs.move(sids[0], "t", lost)
        status = rs.status()
        assert status["replicas"][lost]["state"] == "lost"
        assert status["replicas"][1 - lost]["sessions"] == len(sids)
    finally:
        asyncio.run(asyncio.wait_for(_close(rs), 60))


def test_losing_every_replica_is_fatal(tmp_path: Path) -> None:
    rs, _ = _replicas(tmp_path)
    heard: list[BaseException] = []
    rs.on_fatal = heard.append
    try:
        rs.fail(0, "operator")
        assert rs.lost.keys() == {0} and rs.fatal is None and not heard
        (turn,) = _run(rs, _turn(rs, _job("x", [65, 66, 67], 4)))
        assert turn.error is None and rs.home_of("x", "t") == 1
        rs.fail(1, "operator")
        assert rs.fatal is not None and heard == [rs.fatal]
        (turn,) = _run(rs, _turn(rs, _job("x", [65, 66, 67], 4)))
        assert turn.error is not None
    finally:
        asyncio.run(asyncio.wait_for(_close(rs), 60))


def test_http_server_with_two_replicas(tmp_path: Path) -> None:
    """The real server with `--replicas cpu,cpu`: sessions spread over both replicas, a
    session's next turn restores what its first committed, and every reply equals a fresh
    session's over the same conversation."""
    from server_proc import Server, chat, reply_text

    srv = Server(tmp_path / "l3", "--replicas", "cpu,cpu", "--max-concurrency", "4").start()
    try:
        convs = {f"h{i}": [{"role": "user", "content": f"hello {i} " * (3 + 5 * i)}]
                 for i in range(3)}  # fmt: skip
        for sid, conv in convs.items():
            conv += [{"role": "assistant", "content": reply_text(chat(srv.url, sid, conv))}]
            conv += [{"role": "user", "content": "and then?"}]
        for sid, conv in convs.items():
            second = chat(srv.url, sid, conv)
            assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert reply_text(second) == reply_text(chat(srv.url, sid + "-fresh", conv))
    finally:
        assert srv.stop() == 0, srv.output()
