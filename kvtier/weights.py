"""A digest of a model's weights, so KV computed by other weights is never served.

Two models of one config, or new weights deployed at the same path, give different KV for the
same tokens. The model fingerprint (kvtier.geometry.model_fingerprint) therefore includes this
digest. It covers every byte of every parameter and persistent buffer, not a sample: a fine-tune
that touched one row of one matrix must not share chunks with its base model.

Tensors in host memory are hashed byte for byte with blake2b. Tensors on a GPU are reduced where
they live, so the weights never cross PCIe: each is viewed as integers of its element width, and
two wrapping int64 sums are taken over it, the plain sum and a sum weighted by the element's
position (so swapped elements change it too). Integer addition is associative, so the result does
not depend on the device's reduction order. The sums of all tensors reach the host in one copy at
the end, and the name, shape and dtype of each tensor are hashed beside them. (The same weights
on a CPU and on a GPU therefore give different digests; their KV is not shared, which costs
nothing, since one process serves from one device.)

Cost: one read of the weights. 15 GB of bf16 weights are about 3 ms of HBM bandwidth on an H200;
the element-wise work and kernel launches dominate (`bench/weights_digest.py` measures it).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

# Elements reduced per kernel launch: bounds the int64 temporaries (8 bytes an element).
_BLOCK = 1 << 24
# Position weights cycle with this prime period, so they stay small and never need int64
# multiplication to overflow in a way that depends on the block size.
_PERIOD = 65521

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_digest(model: Any) -> bytes:
    """16 bytes naming the exact values of `model`'s parameters and persistent buffers."""
    named = sorted(model.state_dict().items())
    digest = hashlib.blake2b(digest_size=16)
    sums: list[torch.Tensor] = []
    weights: dict[torch.device, torch.Tensor] = {}  # position weights, one per device
    with torch.no_grad():
        for name, tensor in named:
            digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}\n".encode())
            dev = tensor.device
            if dev.type == "cpu":  # host memory: hash the bytes themselves (blake2b, ~1 GB/s)
                raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                digest.update(raw.numpy().data)
                continue
            if dev not in weights:
                pos = torch.arange(_BLOCK + _PERIOD, device=dev, dtype=torch.int64)
                weights[dev] = pos.remainder_(_PERIOD).add_(1)
            sums.append(_tensor_sums(tensor, weights[dev]))
    if sums:
        host = torch.stack([s.to("cpu") for s in sums])
        digest.update(host.numpy().tobytes())
    return digest.digest()


def _tensor_sums(tensor: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[plain sum, position-weighted sum] of the tensor's bits as int64, on its device."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        ints = flat.to(torch.uint8)
    else:
        ints = flat.view(_INT_OF_WIDTH[flat.element_size()])
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, ints.numel(), _BLOCK):
        block = ints[start : start + _BLOCK]
        # the weight of element i is (i mod _PERIOD) + 1, whichever block it falls in
        total[0] += block.sum(dtype=torch.int64)
        total[1] += (block * weight[start % _PERIOD : start % _PERIOD + block.numel()]).sum()
    return total
