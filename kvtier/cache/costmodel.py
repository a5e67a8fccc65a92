"""Never slower than recompute: measured bandwidths vs measured prefill speed.

The cache reports every load (bytes, seconds, source tier) and every prefill (tokens, seconds);
this object keeps exponential moving averages and answers how many leading chunks of a restore
are worth loading. No torch, no I/O: a pure object, tested as such.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class CostModel:
    def __init__(
        self,
        bandwidth: Mapping[str, float],
        prefill_s_per_token: float,
        *,
        alpha: float = 0.3,
        margin: float = 1.0,
    ) -> None:
        self.bandwidth = dict(bandwidth)  # bytes/s by source tier
        self.prefill_s_per_token = prefill_s_per_token
        self.alpha = alpha
        self.margin = margin
        self.samples: dict[str, int] = {}

    def _ema(self, old: float, new: float, name: str) -> float:
        n = self.samples.get(name, 0)
        self.samples[name] = n + 1
        return new if n == 0 else (1 - self.alpha) * old + self.alpha * new

    def observe_load(self, src: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        self.bandwidth[src] = self._ema(self.bandwidth.get(src, 0.0), nbytes / seconds, src)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self.prefill_s_per_token = self._ema(self.prefill_s_per_token, seconds / tokens, "prefill")

    def load_seconds(self, src: str, nbytes: int) -> float:
        return nbytes / self.bandwidth[src]

    def recompute_seconds(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token

    def plan(self, segments: Sequence[tuple[str, int, int]]) -> int:
        """How many leading segments to load. segments[i] = (source, bytes, tokens).

        Loading segment i only helps if the whole prefix through i is cheaper to load than to
        recompute; pick the prefix length with the largest saving (0 = recompute everything).
        """
        best_k, best_saving = 0, 0.0
        load = tokens = 0.0
        for k, (src, nbytes, ntok) in enumerate(segments, start=1):
            load += self.load_seconds(src, nbytes) * self.margin
            tokens += ntok
            saving = self.recompute_seconds(int(tokens)) - load
            if saving > best_saving:
                best_k, best_saving = k, saving
        return best_k
