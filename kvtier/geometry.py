"""KV geometry of a model: how many bytes one token costs, derived from its transformers config.

Every size, budget and capacity plan in kvtier goes through `KVGeometry`
(docs/architecture.md, "KV geometry").
The usual `2 x layers x hidden x bytes` formula is wrong for grouped-query and latent attention;
here the count uses KV heads (GQA/MQA) or the compressed latent (MLA). No torch at import: the
dtype is a string, mapped to a torch dtype only where a tensor is made.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier import units as _units
from kvtier.errors import ConfigError

ELEMENT_SIZES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
ATTENTIONS = ("mha", "gqa", "mqa", "mla")
# Spellings seen in config.json files and torch reprs, mapped to kvtier's names.
_DTYPE_ALIASES: dict[str, str] = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
# Used only when the config names no dtype: transformers then loads the weights in float32.
DEFAULT_DTYPE = "float32"


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one model's KV cache: what a chunk of tokens holds and how many bytes it takes."""

    num_layers: int
    num_kv_heads: int  # MLA: 1 (one latent "head")
    head_dim: int  # K head dim (MLA: kv_lora_rank + qk_rope_head_dim)
    v_head_dim: int  # V head dim (MLA: 0, the latent holds both)
    dtype: str  # "bfloat16" | "float16" | "float32"
    attention: str  # "mha" | "gqa" | "mqa" | "mla"
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()  # layer indices that use the sliding window

    def __post_init__(self) -> None:
        if self.dtype not in ELEMENT_SIZES:
            raise ConfigError(
                f"KV dtype {self.dtype!r} is not supported; use one of {sorted(ELEMENT_SIZES)}"
            )
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"attention {self.attention!r} is not one of {ATTENTIONS}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KV geometry {name} must be a positive integer, got {value!r}")
        if self.v_head_dim < 0:
            raise ConfigError(f"KV geometry v_head_dim must be >= 0, got {self.v_head_dim}")
        if self.attention == "mla" and (self.v_head_dim != 0 or self.num_kv_heads != 1):
            raise ConfigError("an MLA geometry has one latent head and v_head_dim 0")
        if self.attention != "mla" and self.v_head_dim == 0:
            raise ConfigError("v_head_dim 0 is only valid for MLA (the latent holds K and V)")
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"sliding_layers {bad} are outside 0..{self.num_layers - 1}")
        if self.sliding_layers and not self.sliding_window:
            raise ConfigError("sliding_layers are given but sliding_window is not")

    @property
    def element_size(self) -> int:
        """Bytes per element of the KV dtype."""
        return ELEMENT_SIZES[self.dtype]

    @property
    def kv_planes(self) -> int:
        """Planes per layer in a chunk: 2 (K and V), or 1 for MLA's shared latent."""
        return 1 if self.attention == "mla" else 2

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token holds across all layers, K and V (MLA: the latent)."""
        per_layer = self.num_kv_heads * (self.head_dim + self.v_head_dim)
        return self.num_layers * per_layer * self.element_size

    def chunk_bytes(self, chunk_tokens: int) -> int:
        """Bytes of a chunk of `chunk_tokens` tokens in the model's dtype (the native codec)."""
        if chunk_tokens < 0:
            raise ConfigError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
        return chunk_tokens * self.bytes_per_token

    def chunk_shape(self, ntokens: int) -> tuple[int, int, int, int, int]:
        """Logical shape of a chunk: [layer, k|v (1 for MLA), token, kv_head, head_dim]."""
        if self.attention != "mla" and self.v_head_dim != self.head_dim:
            raise ConfigError(
                f"K head dim {self.head_dim} != V head dim {self.v_head_dim}: the chunk layout "
                "[layer, k|v, token, head, dim] needs equal dims; this model is not supported yet"
            )
        return (self.num_layers, self.kv_planes, ntokens, self.num_kv_heads, self.head_dim)

    def torch_dtype(self) -> Any:
        """The torch dtype of the KV (imports torch on first use only)."""
        import torch

        return getattr(torch, self.dtype)

    @classmethod
    def from_config(cls, config: Any, dtype: str | None = None) -> KVGeometry:
        """Derive the geometry from a transformers `PretrainedConfig` or a config.json dict.

        Handles GQA/MQA (`num_key_value_heads`, `multi_query`), an explicit `head_dim`, MLA
        (`kv_lora_rank`, `qk_rope_head_dim`), sliding-window layers (`layer_types`,
        `use_sliding_window` + `max_window_layers`, `sliding_window_pattern`) and multimodal
        configs that nest the language model under `text_config`.
        """
        cfg = _text_config(config)
        layers = _first_int(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
        heads = _first_int(cfg, "num_attention_heads", "n_head", "num_heads")
        if layers is None or heads is None:
            raise ConfigError(
                "model config has no num_hidden_layers / num_attention_heads; pass the language "
                "model's config.json (for multimodal models, the one holding text_config)"
            )
        kv_dtype = normalize_dtype(dtype) if dtype is not None else _config_dtype(cfg, config)
        window, sliding = _sliding(cfg, layers)

        lora = _first_int(cfg, "kv_lora_rank")
        if lora:
            rope = _first_int(cfg, "qk_rope_head_dim")
            if rope is None:
                raise ConfigError("MLA config has kv_lora_rank but no qk_rope_head_dim")
            return cls(layers, 1, lora + rope, 0, kv_dtype, "mla", window, sliding)

        kv_heads = _first_int(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv")
        if kv_heads is None:
            kv_heads = 1 if _get(cfg, "multi_query") else heads
        head_dim = _first_int(cfg, "head_dim")
        if head_dim is None:
            hidden = _first_int(cfg, "hidden_size", "n_embd", "d_model")
            if hidden is None:
                raise ConfigError("model config has neither head_dim nor hidden_size")
            if hidden % heads:
                raise ConfigError(
                    f"hidden_size {hidden} is not divisible by num_attention_heads {heads}; "
                    "set head_dim in the config"
                )
            head_dim = hidden // heads
        v_head_dim = _first_int(cfg, "v_head_dim") or head_dim
        if kv_heads == heads:
            attention = "mha"
        elif kv_heads == 1:
            attention = "mqa"
        else:
            attention = "gqa"
        return cls(layers, kv_heads, head_dim, v_head_dim, kv_dtype, attention, window, sliding)


def normalize_dtype(value: Any) -> str:
    """Map "bf16", "torch.bfloat16", torch.float16 ... to kvtier's dtype names."""
    text = str(value).removeprefix("torch.").lower()
    if text not in _DTYPE_ALIASES:
        raise ConfigError(
            f"KV dtype {value!r} is not supported; use one of {sorted(ELEMENT_SIZES)}"
        )
    return _DTYPE_ALIASES[text]


def _get(cfg: Any, name: str) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name)
    return getattr(cfg, name, None)


def _first_int(cfg: Any, *names: str) -> int | None:
    for name in names:
        value = _get(cfg, name)
        if value is not None and not isinstance(value, bool):
            return int(value)
    return None


def _text_config(config: Any) -> Any:
    """The language model's part of a config (multimodal configs nest it under text_config)."""
    if _first_int(config, "num_hidden_layers", "n_layer", "num_layers", "n_layers") is not None:
        return config
    nested = _get(config, "text_config") or _get(config, "language_config")
    return nested if nested is not None else config


def _config_dtype(*configs: Any) -> str:
    """The first dtype named by the text config or its multimodal parent."""
    for cfg in configs:
        value = _get(cfg, "dtype") or _legacy_dtype(cfg)
        if value is not None:
            return normalize_dtype(value)
    return DEFAULT_DTYPE


def _legacy_dtype(cfg: Any) -> Any:
    """`torch_dtype`, the older name of `dtype`: a config.json key, or a stored attribute. On a
    transformers config it is a property that logs "`torch_dtype` is deprecated" when read, and
    only returns `dtype` (read above), so it is never read there."""
    if isinstance(cfg, Mapping):
        return cfg.get("torch_dtype")
    return getattr(cfg, "__dict__", {}).get("torch_dtype")


def _sliding(cfg: Any, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the layers that use it, across the spellings of recent models."""
    window = _first_int(cfg, "sliding_window")
    layer_types = _get(cfg, "layer_types")
    if layer_types:
        sliding = tuple(i for i, kind in enumerate(layer_types) if "sliding" in str(kind))
    elif _get(cfg, "use_sliding_window") is False:
        sliding = ()  # Qwen2 ships a sliding_window value but turns it off
    elif _get(cfg, "use_sliding_window") is True:
        first = _first_int(cfg, "max_window_layers") or 0
        sliding = tuple(range(first, layers))
    elif pattern := _first_int(cfg, "sliding_window_pattern"):
        sliding = tuple(i for i in range(layers) if (i + 1) % pattern)  # Gemma 3: every Nth full
    elif window:
        sliding = tuple(range(layers))  # Mistral v0.1: every layer slides
    else:
        sliding = ()
    if not window or not sliding:
        return None, ()
    return window, sliding


def _rope(cfg: Any) -> dict[str, Any]:
    """Rope theta and scaling in one normalized dict, whichever spelling the config uses.

    transformers 5 folds `rope_theta` and `rope_scaling` into `rope_parameters`; a config.json
    of an older release has them apart. Both must give the same fingerprint.
    """
    merged: dict[str, Any] = {}
    for name in ("rope_scaling", "rope_parameters"):
        value = _get(cfg, name)
        if isinstance(value, Mapping):
            merged.update(value)
    theta = _get(cfg, "rope_theta")
    if theta is not None:
        merged.setdefault("rope_theta", theta)
    if "type" in merged:
        merged.setdefault("rope_type", merged.pop("type"))
    if merged.get("rope_type") == "default":
        merged.pop("rope_type")
    for name in ("partial_rotary_factor", "rotary_dim"):
        value = _get(cfg, name)
        if value is not None:
            merged.setdefault(name, value)
    return {
        k: (float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v)
        for k, v in sorted(merged.items())
    }


def _format_version() -> int:
    try:
        from kvtier.kvbin import FORMAT_VERSION
    except ImportError:  # the .kvbin module is optional for geometry users
        return 1
    return int(FORMAT_VERSION)


def model_fingerprint(
    config: Any,
    geometry: KVGeometry,
    *,
    model_id: str,
    codec: str,
    weights_digest: bytes | None = None,
) -> bytes:
    """16 bytes naming everything that makes stored KV incompatible.

    See docs/architecture.md, "Chunks and their keys".

    Covers the model id, layers, KV heads, head dims, rope theta and scaling, sliding window,
    KV dtype, storage codec, .kvbin format version and an optional weights digest. It is a
    digest of canonical JSON, so it is stable across processes and machines.
    """
    record = {
        "model_id": model_id,
        "layers": geometry.num_layers,
        "kv_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
        "v_head_dim": geometry.v_head_dim,
        "attention": geometry.attention,
        "sliding_window": geometry.sliding_window,
        "sliding_layers": list(geometry.sliding_layers),
        "dtype": geometry.dtype,
        "rope": _rope(_text_config(config)),
        "codec": codec,
        "format_version": _format_version(),
        "weights": weights_digest.hex() if weights_digest is not None else None,
    }
    blob = json.dumps(record, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(blob.encode(), digest_size=16).digest()


# Sizes are read by kvtier.units (one meaning everywhere); the name stays importable from here.
parse_size = _units.parse_size
