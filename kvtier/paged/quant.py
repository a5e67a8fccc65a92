"""int8 K/V for the page pool (degraded mode): symmetric absmax, one scale per (token, kv head).

A row `x` of `head_dim` values is stored as `q = round(x / s)` in int8 with `s = max|x| / 127`
(float32), and read back as `q * s`. Each value is then off by at most `s / 2 = max|x| / 254`
(plus the rounding of the model's dtype when it is cast back). A page of int8 K/V holds
`head_dim + 4` bytes per (token, kv head) where the model's dtype holds `2 * head_dim` (fp16,
bf16) or `4 * head_dim` (fp32): about twice or four times the tokens in the same bytes.

A non-finite input row gets a NaN scale, so it reads back as NaN: never as finite numbers.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
SCALE_DTYPE = torch.float32
KV_DTYPES = ("native", "int8")  # how a page pool stores K/V


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[..., head_dim]` as int8 values of the same shape and float32 scales `[...]`."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(xf / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX)
    return q.nan_to_num_(0.0).to(torch.int8), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values `quantize_kv` stored: `q * scale`, `[..., head_dim]` in `dtype`."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def bytes_per_value(kv_dtype: str, dtype: torch.dtype, head_dim: int) -> int:
    """Bytes one (token, kv head) row of K or V takes in a pool storing `kv_dtype`."""
    if kv_dtype == "int8":
        return head_dim + torch.empty((), dtype=SCALE_DTYPE).element_size()
    return head_dim * torch.empty((), dtype=dtype).element_size()
