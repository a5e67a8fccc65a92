"""Cold-tier codecs: how a chunk is stored in L2/L3 (docs/architecture.md, "Tiers").

A codec turns a chunk tensor `[layer, k|v, token, kv_head, dim]` in the model's dtype into one
flat uint8 payload and back. It runs on the device that holds the chunk (the GPU in production),
so quantization happens before the copy down and dequantization after the copy up; only the
payload crosses PCIe.

- `native`: the model's own bytes, bit-exact; encode and decode are views, no copy.
- `int8`: symmetric int8 with per-channel scales for K (one per layer, head and dim, over the
  chunk's tokens: K's outliers sit in fixed channels) and per-token scales for V (one per layer,
  token and head). MLA's single latent plane is treated like K.
- `fp8`: float8 e4m3 with the same scale layout as int8 (the scale maps each group's absmax to
  448, e4m3's largest finite value), so small values keep their relative precision.

Payload layout of the quantized codecs: the 1-byte codes `[L, P, n, H, D]` (padded to 16 bytes
so the scales stay aligned), then the K (plane 0)
scales `[L, H, D]` as float32, then the V (plane 1) scales `[L, n, H]` as float32.
"""

from __future__ import annotations

import math
import struct
import time
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.kvbin import ChunkHeader

if TYPE_CHECKING:
    from torch import Tensor

# Stable numeric ids for the .kvbin header's codec flag; never renumber.
CODEC_IDS: dict[str, int] = {"native": 0, "int8": 1, "fp8": 2}
_SCALE_BYTES = 4  # float32 scales
_PARAMS_VERSION = 1


class Codec:
    """Base class: encode a chunk to a flat uint8 payload and decode it back."""

    name = "native"

    def __init__(self, geometry: KVGeometry) -> None:
        self.geometry = geometry
        geometry.chunk_shape(0)  # fails early for layouts the chunk format cannot hold

    @property
    def code(self) -> int:
        """The numeric id stored in .kvbin headers."""
        return CODEC_IDS[self.name]

    @property
    def lossless(self) -> bool:
        return True

    def payload_bytes(self, ntokens: int) -> int:
        """Bytes of the encoded payload of `ntokens` tokens."""
        return self.geometry.chunk_bytes(ntokens)

    def params(self) -> bytes:
        """Codec parameters for the .kvbin header: what a reader needs to decode the payload."""
        return struct.pack("<BBB", _PARAMS_VERSION, self.code, 0)

    def header(
        self,
        key: bytes,
        ntokens: int,
        *,
        fingerprint: bytes,
        tenant: str,
        parent: bytes = bytes(16),
    ) -> ChunkHeader:
        """The .kvbin header of a chunk of `ntokens` tokens that this codec encoded: the
        geometry, codec and payload fields come from here, the identity from the caller."""
        g = self.geometry
        return ChunkHeader(
            key=key,
            parent=parent,
            fingerprint=fingerprint,
            tenant=tenant,
            tokens=ntokens,
            layers=g.num_layers,
            kv_heads=g.num_kv_heads,
            head_dim=g.head_dim,
            dtype=g.dtype,
            codec=self.name,
            codec_params=self.params(),
            payload_len=self.payload_bytes(ntokens),
            created=time.time(),
        )

    def scratch_elems(self, ntokens: int) -> int:
        """float32 elements of the work buffer `encode`/`decode` take as `scratch` (0: none)."""
        return 0

    def encode(
        self, chunk: Tensor, out: Tensor | None = None, scratch: Tensor | None = None
    ) -> Tensor:
        """Encode `chunk` [L, P, n, H, D]; returns a flat uint8 tensor of payload_bytes(n).

        `scratch`, a float32 tensor of at least scratch_elems(n) elements on the chunk's
        device, is the only work memory used when given: the transfer engine passes one it
        allocated once, so encoding on a side stream allocates nothing from the model's pool.
        """
        raise NotImplementedError

    def decode(
        self,
        payload: Tensor,
        ntokens: int,
        out: Tensor | None = None,
        scratch: Tensor | None = None,
    ) -> Tensor:
        """Decode a payload of `ntokens` tokens into [L, P, n, H, D] in the model's dtype
        (`scratch` as for `encode`)."""
        raise NotImplementedError

    def _check_chunk(self, chunk: Tensor) -> int:
        shape = tuple(chunk.shape)
        ntokens = shape[2] if len(shape) == 5 else -1
        if shape != self.geometry.chunk_shape(ntokens) or ntokens < 0:
            raise ConfigError(
                f"chunk shape {shape} does not match the geometry's "
                f"{self.geometry.chunk_shape(max(ntokens, 0))}; gather with the same KVGeometry"
            )
        if chunk.dtype != self.geometry.torch_dtype():
            raise ConfigError(
                f"chunk dtype {chunk.dtype} is not the geometry's {self.geometry.dtype}; L1 must "
                "hold the model's own dtype"
            )
        return ntokens

    def _check_payload(self, payload: Tensor, ntokens: int) -> Tensor:
        import torch

        need = self.payload_bytes(ntokens)
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() < need:
            raise ConfigError(
                f"{self.name} payload for {ntokens} tokens must be a flat uint8 tensor of at least "
                f"{need} bytes, got {payload.dtype} {tuple(payload.shape)}"
            )
        return payload[:need]


class NativeCodec(Codec):
    """The model's own bytes: bit-exact, and a view rather than a copy when possible."""

    name = "native"

    def encode(
        self, chunk: Tensor, out: Tensor | None = None, scratch: Tensor | None = None
    ) -> Tensor:
        import torch

        self._check_chunk(chunk)
        flat = chunk.contiguous().view(-1).view(torch.uint8)
        if out is None:
            return flat
        out = out[: flat.numel()]
        out.copy_(flat)
        return out

    def decode(
        self,
        payload: Tensor,
        ntokens: int,
        out: Tensor | None = None,
        scratch: Tensor | None = None,
    ) -> Tensor:
        payload = self._check_payload(payload, ntokens)
        shape = self.geometry.chunk_shape(ntokens)
        dtype = self.geometry.torch_dtype()
        if payload.data_ptr() % self.geometry.element_size:
            payload = payload.clone()  # a misaligned slice cannot be reinterpreted in place
        chunk = payload.view(dtype).view(shape)
        if out is None:
            return chunk
        out.copy_(chunk)
        return out


class QuantCodec(Codec):
    """Symmetric 1-byte quantization: per-channel scales for K, per-token scales for V."""

    name = "int8"
    qmax = 127.0

    @property
    def lossless(self) -> bool:
        return False

    def _code_dtype(self) -> Any:
        import torch

        return torch.int8

    def _sizes(self, ntokens: int) -> tuple[int, int, int]:
        g = self.geometry
        codes = _round_up(g.num_layers * g.kv_planes * ntokens * g.num_kv_heads * g.head_dim, 16)
        k_scales = g.num_layers * g.num_kv_heads * g.head_dim * _SCALE_BYTES
        v_scales = (
            (g.num_layers * ntokens * g.num_kv_heads * _SCALE_BYTES) if g.kv_planes == 2 else 0
        )
        return codes, k_scales, v_scales

    def payload_bytes(self, ntokens: int) -> int:
        return sum(self._sizes(ntokens))

    def params(self) -> bytes:
        # version, codec id, scale dtype (1 = float32), K granularity (1 = channel),
        # V granularity (2 = token)
        return struct.pack("<BBBBB", _PARAMS_VERSION, self.code, 1, 1, 2)

    def scratch_elems(self, ntokens: int) -> int:
        g = self.geometry
        return g.num_layers * ntokens * g.num_kv_heads * g.head_dim  # one plane in float32

    def _work(self, scratch: Tensor | None, like: Tensor) -> Tensor:
        """A float32 buffer shaped like one plane `like` [L, n, H, D]: `scratch`, or a new one."""
        import torch

        n = like.numel()
        if scratch is None:
            return torch.empty(like.shape, dtype=torch.float32, device=like.device)
        if scratch.dtype != torch.float32 or scratch.numel() < n or scratch.device != like.device:
            raise ConfigError(
                f"{self.name} scratch must be float32 with >= {n} elements on {like.device}, "
                f"got {scratch.dtype} {scratch.numel()} on {scratch.device}; size it with "
                "scratch_elems()"
            )
        return scratch.view(-1)[:n].view(like.shape)

    def _round(self, work: Tensor) -> None:
        work.round_()  # int8 codes are integers; fp8 rounds in the cast instead

    def _quantize(self, x: Tensor, scale: Tensor, work: Tensor, codes: Tensor) -> None:
        """codes = clamp(round(x / scale)), computed in `work` (float32)."""
        import torch

        torch.div(x, scale, out=work)
        self._round(work)
        work.clamp_(-self.qmax, self.qmax)
        codes.copy_(work)

    def _scale(self, x: Tensor, dim: int) -> Tensor:
        """absmax of x over `dim` / qmax, in float32 and never 0 (aminmax: no |x| temporary)."""
        import torch

        lo, hi = torch.aminmax(x, dim=dim)
        tiny = torch.finfo(torch.float32).tiny
        return torch.maximum(hi.float(), lo.float().neg_()).clamp_(min=tiny).div_(self.qmax)

    def encode(
        self, chunk: Tensor, out: Tensor | None = None, scratch: Tensor | None = None
    ) -> Tensor:
        import torch

        ntokens = self._check_chunk(chunk)
        n_codes, n_k, n_v = self._sizes(ntokens)
        if out is None:
            out = torch.empty(n_codes + n_k + n_v, dtype=torch.uint8, device=chunk.device)
        out = out[: n_codes + n_k + n_v]
        codes = out[: chunk.numel()].view(self._code_dtype()).view(chunk.shape)
        work = self._work(scratch, chunk[:, 0])
        # K (plane 0): one scale per (layer, head, dim), the absmax over the chunk's tokens.
        k = chunk[:, 0]
        k_scale = self._scale(k, 1)  # [L, H, D]
        self._quantize(k, k_scale.unsqueeze(1), work, codes[:, 0])
        _as_f32(out[n_codes : n_codes + n_k]).copy_(k_scale.reshape(-1))
        if n_v:
            # V (plane 1): one scale per (layer, token, head), the absmax over the head dim.
            v = chunk[:, 1]
            v_scale = self._scale(v, -1)  # [L, n, H]
            self._quantize(v, v_scale.unsqueeze(-1), work, codes[:, 1])
            _as_f32(out[n_codes + n_k :]).copy_(v_scale.reshape(-1))
        return out

    def decode(
        self,
        payload: Tensor,
        ntokens: int,
        out: Tensor | None = None,
        scratch: Tensor | None = None,
    ) -> Tensor:
        import torch

        payload = self._check_payload(payload, ntokens)
        g = self.geometry
        shape = g.chunk_shape(ntokens)
        n_codes, n_k, n_v = self._sizes(ntokens)
        if payload.data_ptr() % _SCALE_BYTES:
            payload = payload.clone()
        codes = payload[: math.prod(shape)].view(self._code_dtype()).view(shape)
        dtype = g.torch_dtype()
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=payload.device)
        work = self._work(scratch, codes[:, 0])
        k_scale = _as_f32(payload[n_codes : n_codes + n_k]).view(
            g.num_layers, 1, g.num_kv_heads, g.head_dim
        )
        # float8 takes part in no type promotion: widen the codes first, then scale in place
        work.copy_(codes[:, 0])
        out[:, 0].copy_(work.mul_(k_scale))
        if n_v:
            v_scale = _as_f32(payload[n_codes + n_k :]).view(
                g.num_layers, ntokens, g.num_kv_heads, 1
            )
            work.copy_(codes[:, 1])
            out[:, 1].copy_(work.mul_(v_scale))
        return out


class Fp8Codec(QuantCodec):
    """float8 e4m3 codes with int8's scale layout; absmax maps to 448 (e4m3's largest value)."""

    name = "fp8"
    qmax = 448.0

    def _code_dtype(self) -> Any:
        import torch

        return torch.float8_e4m3fn

    def _round(self, work: Tensor) -> None:
        pass  # the cast to e4m3 rounds to its own grid


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _as_f32(raw: Tensor) -> Tensor:
    import torch

    return raw.view(torch.float32)


_CODECS: dict[str, type[Codec]] = {"native": NativeCodec, "int8": QuantCodec, "fp8": Fp8Codec}


def make_codec(name: str, geometry: KVGeometry) -> Codec:
    """The codec called `name` ("native" | "int8" | "fp8") for chunks of `geometry`."""
    try:
        cls = _CODECS[name]
    except KeyError:
        raise ConfigError(
            f"unknown codec {name!r}; choose one of {sorted(_CODECS)} (native is bit-exact)"
        ) from None
    return cls(geometry)
