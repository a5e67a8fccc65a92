"""Where a range of tokens lies in L1: the views a device copy reads or writes, and the
checks that refuse a range that does not fit (used by kvtier.transfer.device)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.tiers.l1 import block_of

Layers = Sequence[Sequence[torch.Tensor]]  # per layer (K, V), each [1, H, capacity, D]


def l1_views(
    geometry: KVGeometry,
    layers: Layers,
    block: torch.Tensor | None,
    first: int,
    count: int,
    length: int,
) -> tuple[list[torch.Tensor], bool]:
    """Tokens [first, first + count*length) of every layer and plane, and whether fused.

    Fused (`block`, L1Pool's one-allocation layout): one view [L*P, H, count, length, D],
    moved by one copy. Otherwise one view [H, count, length, D] per layer and plane,
    layer-major.
    """
    planes = geometry.kv_planes
    if block is not None:
        span = block[:, :planes, 0].flatten(0, 1)[:, :, first : first + count * length]
        return [span.unflatten(2, (count, length))], True
    views = []
    for pair in layers:
        for t in pair[:planes]:
            s = t.stride()
            views.append(
                t.as_strided(
                    (t.shape[1], count, length, t.shape[3]),
                    (s[1], length * s[2], s[2], s[3]),
                    t.storage_offset() + first * s[2],
                )
            )
    return views, False


def check_range(
    geometry: KVGeometry,
    chunk_tokens: int,
    device: torch.device,
    layers: Layers,
    start: int,
    ntokens: int,
    slots: Sequence[int],
    block: torch.Tensor | None,
) -> torch.Tensor | None:
    """Refuse a range that does not fit; returns the L1 block behind `layers`, if any.

    A `block` given by the caller (L1Pool's, with its views as `layers`) is checked in
    O(1); without one, every layer is checked and the block is looked for
    (`l1.block_of`), which costs tens of microseconds per call on a 28-layer model.
    """
    g = geometry
    if len(layers) != g.num_layers:
        raise ConfigError(f"got {len(layers)} layers but the geometry has {g.num_layers}")
    n = chunk_tokens
    if ntokens <= 0 or not slots or -(-ntokens // n) != len(slots):
        raise ConfigError(
            f"{ntokens} tokens need {-(-ntokens // n)} slots of {n} tokens, got {len(slots)}"
        )
    end = start + ntokens
    if block is not None:
        if not (
            block.dim() == 6
            and block.shape[0] == g.num_layers
            and layers[0][0]._base is block  # noqa: SLF001  # torch's view base
            and layers[-1][g.kv_planes - 1]._base is block  # noqa: SLF001
        ):
            raise ConfigError("block is not the L1Pool block these layers are views of")
        tensors: Sequence[torch.Tensor] = [block[0, 0]]
    else:
        tensors = [t for pair in layers for t in pair[: g.kv_planes]]
    for t in tensors:
        if (
            t.dim() != 4
            or t.shape[1] != g.num_kv_heads
            or t.shape[3] != g.head_dim
            or not 0 <= start <= end <= t.shape[2]
            or t.device != device
        ):
            raise ConfigError(
                f"tokens [{start}, {end}) do not fit an L1 buffer of shape "
                f"{tuple(t.shape)} on {t.device}; expected [1, {g.num_kv_heads}, "
                f">= {end}, {g.head_dim}] on {device}"
            )
    return block if block is not None else block_of(layers)
