"""Never slower than recompute: measured bandwidths vs measured prefill speed.

The cache reports every load (bytes, seconds, source tier) and every prefill (tokens, seconds);
this object keeps exponential moving averages and answers how many leading chunks of a restore
are worth loading. No torch, no I/O: a pure object, tested as such.

Estimates move in log space: each sample moves one `alpha` of the way toward itself, but never
more than `outlier` x at once, so a real change of orders of magnitude (a throttled disk) is
learnt in a handful of samples while small noise is averaged. Two guards keep one bad
measurement from locking a tier out for good. A tier that the plan rejects is never measured
again, so a single slow sample (the first restore of a process pays for lazy CUDA set-up) could
otherwise make every later restore from it a recompute. Hence the `outlier` bound, from the
very first sample on, and after `probe_every` plans in a row that turned a tier down, the next
plan loads it once more to measure it again.

The first read of a tier in a process pays for lazy set-up, which is why its sample is bounded;
but a bounded first sample can leave a tier's estimate many times too fast (on an H200 the
built-in model's first L3 sample was bounded from 31 MB/s up to 250 MB/s, and the first request
after a restart then loaded 1.7x slower than it would have recomputed). So `kvtier serve`'s
warm-up, with the set-up paid, restores once more under `calibrating`: plans load everything,
and each sample replaces the estimate outright.

Prefill is different in two ways. It is measured on every forward of several tokens, whatever
the plan said, so it needs no lock-out guard: its first sample replaces the configured guess
outright. (A 7B model on an H200 prefills at 27 us a token, 37 x under the 1 ms guess; bounded,
the first turns of a process took 4 x too long a recompute for granted and loaded from L3 at
1.2-1.9 x the time of recomputing.) And a short forward costs the host its launch time whatever
its length (a 7B model on that GPU: about 20 ms for 1 token or for 200), so its time per token
says nothing about recomputing a long prefix. Once one sample is in, forwards of fewer than
`prefill_min_tokens` are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


class CostModel:
    def __init__(
        self,
        bandwidth: Mapping[str, float],
        prefill_s_per_token: float,
        *,
        alpha: float = 0.5,
        margin: float = 1.0,
        outlier: float = 4.0,
        probe_every: int = 32,
        prefill_min_tokens: int = 512,
    ) -> None:
        self.bandwidth = dict(bandwidth)  # bytes/s by source tier
        self.prefill_s_per_token = prefill_s_per_token
        self.alpha = alpha
        self.margin = margin
        self.outlier = outlier
        self.probe_every = probe_every
        self.prefill_min_tokens = prefill_min_tokens
        self.latency: dict[str, float] = {}  # seconds per round trip by source tier (L4)
        self.samples: dict[str, int] = {}
        # while set: every plan loads all segments, and samples replace the estimates (see the
        # module docstring); for a warm-up that has paid the set-up of every path
        self.calibrating = False
        self.turned_down: dict[str, int] = {}  # plans in a row that rejected this tier
        self.probes = 0

    def _ema(self, old: float, new: float, name: str, *, bound_first: bool = True) -> float:
        """Move `old` toward the sample `new` in log space: all the way for the first sample
        (within `outlier` x unless `bound_first` is off), `alpha` of the way later."""
        n = self.samples.get(name, 0)
        self.samples[name] = n + 1
        if old <= 0 or (n == 0 and not bound_first) or self.calibrating:
            return new
        limit = math.log(self.outlier)
        step = (1.0 if n == 0 else self.alpha) * math.log(new / old)
        return old * math.exp(max(-limit, min(limit, step)))

    def observe_load(self, src: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        self.bandwidth[src] = self._ema(self.bandwidth.get(src, 0.0), nbytes / seconds, src)

    def observe_latency(self, src: str, seconds: float) -> None:
        """A round trip to `src` (a tier behind a network: L4); each plan that loads from it
        pays it once on top of its bytes."""
        if seconds <= 0:
            return
        name = f"{src}_latency"
        self.latency[src] = self._ema(self.latency.get(src, 0.0), seconds, name, bound_first=False)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if tokens < self.prefill_min_tokens and self.samples.get("prefill", 0):
            return  # bound by launching kernels: says nothing about a long recompute
        self.prefill_s_per_token = self._ema(
            self.prefill_s_per_token, seconds / tokens, "prefill", bound_first=False
        )

    def load_seconds(self, src: str, nbytes: int) -> float:
        return nbytes / self.bandwidth[src]

    def plan_latency(self, src: str, seen: set[str]) -> float:
        """The round trip of `src` if this plan has not paid it yet."""
        if src in seen:
            return 0.0
        seen.add(src)
        return self.latency.get(src, 0.0)

    def recompute_seconds(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token

    def plan(self, segments: Sequence[tuple[str, int, int]]) -> int:
        """How many leading segments to load. segments[i] = (source, bytes, tokens).

        Loading segment i only helps if the whole prefix through i is cheaper to load than to
        recompute; pick the prefix length with the largest saving (0 = recompute everything).
        """
        if self.calibrating:
            return len(segments)
        best_k, best_saving = 0, 0.0
        load = tokens = 0.0
        seen: set[str] = set()
        for k, (src, nbytes, ntok) in enumerate(segments, start=1):
            load += (self.load_seconds(src, nbytes) + self.plan_latency(src, seen)) * self.margin
            tokens += ntok
            saving = self.recompute_seconds(int(tokens)) - load
            if saving > best_saving:
                best_k, best_saving = k, saving
        if best_k < len(segments):
            rejected = segments[best_k][0]
            self.turned_down[rejected] = self.turned_down.get(rejected, 0) + 1
            if self.turned_down[rejected] >= self.probe_every:  # measure it again, once
                self.turned_down[rejected] = 0
                self.probes += 1
                return len(segments)
        for src, _, _ in segments[:best_k]:
            self.turned_down[src] = 0
        return best_k
