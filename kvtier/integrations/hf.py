"""transformers integration: a `Cache` whose layers are kvtier's L1 buffers, and `generate()`.

`KvtierCache` is what `Session.restore()` returns. Attention reads the session's L1 buffers
directly (exact attention, no copy): each layer's `update` writes the new tokens into spare
room of the preallocated buffer and returns views of the filled part. When a forward needs more
room than the buffer has, the owner grows every layer by whole chunks (see `kvtier.tiers.l1`).

This module imports no other part of kvtier at import time except the L1 types, so that
`kvtier.cache` can build on it; `generate()` takes the `TieredCache` duck-typed.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtier.tiers.l1 import SessionBuffers


class L1Owner(Protocol):
    """What a layer needs from the session that owns the buffers."""

    bufs: SessionBuffers
    lengths: list[int]

    def ensure_capacity(self, tokens: int) -> None: ...
    def on_forward(self, layer_idx: int, new_tokens: int) -> None: ...


class _Plane:
    """A `KvtierLayer`'s `keys` (plane 0) or `values` (plane 1): a view of the filled part of
    the layer's buffer, made when read. `CacheLayerMixin.__init__` sets both to None; nothing
    else may set them."""

    def __init__(self, plane: int) -> None:
        self.plane = plane

    def __get__(self, layer: KvtierLayer | None, kind: type | None = None) -> Any:
        return self if layer is None else layer.filled(self.plane)

    def __set__(self, layer: KvtierLayer, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError(
                "a kvtier layer's keys and values are views of the session's L1 buffers; "
                "write K/V with update()"
            )


class ListedLayer(CacheLayerMixin):
    """A layer whose length is `_lengths()[layer_idx]`, a list its holder keeps for every
    layer: what kvtier's two Cache layers (L1 buffers, pages) share. `_resized` runs after a
    crop or reset."""

    is_compileable = False
    is_croppable = True
    is_sliding = False
    layer_idx: int

    def _lengths(self) -> list[int]:
        raise NotImplementedError

    def _resized(self) -> None:
        return None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # the storage exists before the first forward

    def _span(self, key_states: torch.Tensor) -> tuple[int, int]:
        """The tokens `[start, end)` a forward's new K/V takes in this layer."""
        if key_states.shape[0] != 1:
            raise ValueError(
                f"a kvtier session holds one sequence; got batch size {key_states.shape[0]}. "
                "Run one session per call, or batch sessions with kvtier.paged.BatchRunner."
            )
        start = self._lengths()[self.layer_idx]
        return start, start + key_states.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._lengths()[self.layer_idx]

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        n = self.get_seq_length()
        keep = n + tokens_to_remove if tokens_to_remove < 0 else min(n, tokens_to_remove)
        self._lengths()[self.layer_idx] = max(0, keep)
        self._resized()

    def reset(self) -> None:
        self.crop(0)

    def offload(self) -> None:  # tiering is kvtier's job, not transformers' offloading
        return None

    def prefetch(self) -> None:
        return None


class KvtierLayer(ListedLayer):
    """One attention layer's KV, stored in the owner's L1 buffers."""

    def __init__(self, owner: L1Owner, layer_idx: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.is_initialized = True
        self.refresh_views()

    # `keys` and `values` are views of the filled part of the layer's buffers, made when read.
    # Attention takes `update`'s return and the batched server copies a session's L1 block
    # whole, so most are never read; made eagerly, a restore and every append of a turn's K/V
    # made two per layer (56 for a 28-layer model), on a helper thread holding the GIL.
    keys = _Plane(0)  # type: ignore[assignment]
    values = _Plane(1)  # type: ignore[assignment]

    def filled(self, plane: int) -> torch.Tensor | None:
        bufs = self.owner.bufs
        if bufs.released:
            return None
        return bufs.layers[self.layer_idx][plane][:, :, : self.owner.lengths[self.layer_idx]]

    def refresh_views(self) -> None:
        """Keep `device` that of the layer's buffers (the views follow the buffers by
        themselves)."""
        if not self.owner.bufs.released:
            self.device = self.owner.bufs.layers[self.layer_idx][0].device

    def _lengths(self) -> list[int]:
        return self.owner.lengths

    def _resized(self) -> None:
        self.refresh_views()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._span(key_states)
        owner, i = self.owner, self.layer_idx
        owner.on_forward(i, key_states.shape[-2])
        if end > owner.bufs.capacity:
            owner.ensure_capacity(end)
        k, v = owner.bufs.layers[i]
        k[:, :, start:end].copy_(key_states)
        v[:, :, start:end].copy_(value_states)
        owner.lengths[i] = end
        return k[:, :, :end], v[:, :, :end]


class KvtierCache(Cache):
    """A transformers `Cache` over one kvtier session's L1 buffers."""

    def __init__(self, owner: L1Owner) -> None:
        layers = [KvtierLayer(owner, i) for i in range(len(owner.bufs.layers))]
        super().__init__(layers=layers)  # type: ignore[arg-type]
        self.owner = owner
        self._own_layers = layers  # `self.layers`, typed

    def extend(self, kv: torch.Tensor) -> None:
        """Append the same `n` tokens to every layer: `kv` is `[layer, k|v, 1, kv_heads, n,
        head_dim]`, the layout of a session's L1 block. One copy when the session's L1 is one
        block, else one per layer and plane. It is a copy, not a forward: the prefill timer
        (`on_forward`) does not see it. Layers of different lengths take `update` one by one."""
        owner = self.owner
        if len(set(owner.lengths)) != 1:
            for i in range(len(owner.lengths) - 1, -1, -1):  # last first: not a prefill
                self.update(kv[i, 0], kv[i, 1], i)
            return
        start = owner.lengths[0]
        end = start + kv.shape[-2]
        if end > owner.bufs.capacity:
            owner.ensure_capacity(end)
        block = owner.bufs.block
        if block is not None:
            block[:, :, :, :, start:end].copy_(kv)
        else:
            for (k, v), new in zip(owner.bufs.layers, kv, strict=True):
                k[:, :, start:end].copy_(new[0])
                v[:, :, start:end].copy_(new[1])
        owner.lengths[:] = [end] * len(owner.lengths)
        for layer in self._own_layers:
            layer.refresh_views()


def set_cudnn_attention(enabled: bool) -> None:
    """Let PyTorch's scaled_dot_product_attention use its cuDNN backend, or not (process-wide).

    cuDNN attention builds an execution plan for every new (query, key) length and caches it:
    about 39 ms of host time on an H200 host, once per forward. A served session meets a new
    length at almost every call (each decode step, each returning turn), so with cuDNN on the
    agent fleet's decode step took 2-3x longer until the process had seen most lengths, minutes
    in (docs/benchmarks.md, "Agent fleet", run G). Off, SDPA uses flash or memory-efficient
    attention, which need no plan. Without CUDA only the flag changes.
    """
    torch.backends.cuda.enable_cudnn_sdp(enabled)


_CACHE_KWARG: dict[type, str] = {}


def cache_kwarg(model: Any) -> str:
    """The keyword that hands a model its KV cache: `cache` where the installed transformers
    knows it (the old `past_key_values` warns there, and goes in 5.40), else `past_key_values`.
    `forward` and `generate` take the same name in any one release."""
    cls = type(model)
    if cls not in _CACHE_KWARG:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[cls]


def generate(
    model: Any,
    cache: Any,
    session_id: str,
    input_ids: torch.Tensor,
    *,
    tenant: str = "default",
    **generate_kwargs: Any,
) -> torch.Tensor:
    """One call: restore the session's longest cached prefix, generate, commit.

    Returns the output ids of `model.generate` (prompt + new tokens).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    session = cache.session(session_id, tenant=tenant)
    pkv = session.restore(input_ids)
    try:
        out = model.generate(
            input_ids.to(model.device),
            use_cache=True,
            **{cache_kwarg(model): pkv},
            **generate_kwargs,
        )
    except BaseException:
        session.abort()
        raise
    session.commit(out)
    return out
