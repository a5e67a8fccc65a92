"""A turn of the batch: one request from its submission to its commit.

`Turn` is the scheduler's unit: what the request asked (`job`), where its events go (`stream`),
its tokens, and where its K/V is at each moment of its life:

- restored (`begin`): `restored` holds its cached prefix, `cached` tokens long; with paged L1 it
  may hold its session's parked pages (`held`, claimed at the restore);
- running: its pages (`paged`, set by `run_in`); with paged L1 its prefix may still be copied
  in from L2 (`loading`), and it joins no step until that is done;
- preempted (`preempt`) or spilled (`spill`): its pages went, its K/V waits in its session's
  Cache or in host memory (`spilled`) until it is admitted again;
- ended (`end`): it left the scheduler, finished or failed (`gone`); its pages were parked
  (`park`) or freed, and its commit runs off the scheduler's thread.

The state changes that several parts make are methods here, so each reads as one event.
"""

from __future__ import annotations

import concurrent.futures
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier.server.batch.turntrace import TurnTrace

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.paged import PagedSequence
    from kvtier.server.backend import Restored
    from kvtier.server.batch.jobs import Job, Stream
    from kvtier.server.decoding.logitproc import Decoding
    from kvtier.server.decoding.sampling import ReplyText
    from kvtier.server.pages import Parked
    from kvtier.transfer.staging import Handle


@dataclass(eq=False)
class Turn:
    """One request inside the batch scheduler."""

    job: Job
    stream: Stream
    admitted: float
    done: concurrent.futures.Future[None]
    reply: ReplyText
    gen: torch.Generator | None
    # prompt + sampled tokens; the last sampled one is fed in the next step. An array: no
    # Python object per id, so the cyclic collector never walks them (a list of a running
    # turn's 3,000 ids was walked id by id by every collection that reached it)
    tokens: array[int]
    restored: Restored | None = None
    cached: int = 0  # leading tokens whose K/V the session's Cache holds
    paged: PagedSequence | None = None  # its pages while running, None while waiting
    first: bool = False  # the first token's logits arrived (TTFT observed)
    # its timing: its latencies on its stream's clock, where the time to its first token went
    trace: TurnTrace = field(init=False)
    # content keys of the full pages of the cached prefix, for (cached, page size)
    keys: tuple[int, int, list[bytes]] | None = None
    # its last token is a placeholder whose value is on the device: (tensor, row)
    feed: tuple[torch.Tensor, int] | None = None
    gone: bool = False  # it left the scheduler (finished or failed)
    # paged L1 (`paged_l1`): its session's parked pages that hold its cached prefix, claimed
    # at its restore, until it is admitted
    held: Parked | None = None
    # restored into L1, and L1 not yet released (see `RestoreWorkers.release_l1`)
    holds_l1: bool = False
    # the K/V [layer, k|v, token, head, dim] of its first `cached` tokens while it waits beside
    # the pool after a preemption or a spill (paged L1)
    spilled: torch.Tensor | None = None
    # paged L1: the copies of its staged prefix into its pages (their transfer Handle, once
    # issued) while they run; it joins no step until they are done
    loading: concurrent.futures.Future[Handle] | None = None
    # steps in a row whose prompt budget ran out before its turn (`kvtier.server.batch.promptorder`)
    passed_over: int = 0
    # its logits processing (penalties, grammar, logprobs), None when it asks for none
    decoding: Decoding | None = None

    def __post_init__(self) -> None:
        self.trace = TurnTrace(self.stream.clock)

    @property
    def fed(self) -> int:
        """Tokens whose K/V exists (in pages while running, in the Cache while waiting)."""
        return self.paged.length if self.paged is not None else self.cached

    @property
    def unfed(self) -> int:
        """Tokens still to feed: 1 while it decodes, more while its prompt prefills."""
        return len(self.tokens) - self.fed

    # ---- its state changes --------------------------------------------------------------------

    def begin(self, restored: Restored, holds_l1: bool = False) -> None:
        """Its restore is done: `restored` covers its first `covered` tokens (`holds_l1`: its
        session stays in L1 until the turn is committed or aborted)."""
        self.restored = restored
        self.cached = restored.covered
        self.holds_l1 = holds_l1

    def claim(self, parked: Parked) -> None:
        """Restored from its session's parked pages, claimed until it is admitted."""
        self.held = parked

    def let_go_of_l1(self) -> bool:
        """Its session may leave L1 again; whether it held L1 until now."""
        held, self.holds_l1 = self.holds_l1, False
        return held

    def run_in(self, table: PagedSequence) -> None:
        """Admitted: its K/V is in `table`'s pages from now on (none waits beside the pool; the
        parked pages it claimed, if it starts from them, are `table`)."""
        self.paged = table
        self.spilled = None
        self.held = None

    def park(self) -> None:
        """Its pages stay as its session's after it ended; it holds none any more."""
        self.paged = None

    def preempt(self, spilled: torch.Tensor | None, kept: bool) -> None:
        """Moved out of the pool: its K/V waits in host memory (`spilled`) or was appended to its
        session's Cache; `kept`: those tokens count as cached (an int8 pool's do not)."""
        assert self.paged is not None
        self.spilled = spilled
        if kept:
            self.cached = self.paged.length

    def spill(self, kv: torch.Tensor) -> None:
        """Its claimed parked pages went: their K/V of its cached prefix waits in host memory."""
        self.spilled = kv

    def unclaim(self) -> Parked | None:
        """It lets go of its session's claimed parked pages (spilled or ended)."""
        held, self.held = self.held, None
        return held

    def lose_pages(self) -> None:
        """Its pages went: released from the pool, or with a pool a device failover replaced,
        unread."""
        self.paged = None

    def lose_prefix(self) -> None:
        """Its parked pages went with a replaced pool: nothing of its prefix is held."""
        self.held, self.cached = None, 0

    def end(self) -> Parked | None:
        """It leaves the scheduler (finished or failed): nothing more is taken for it. Returns
        the parked pages it had claimed and never took, let go of."""
        self.gone = True
        return self.unclaim()
