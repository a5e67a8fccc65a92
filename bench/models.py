"""Model shapes the benchmarks build from a config with random weights (timing does not depend
on the weight values; nothing is downloaded)."""

from __future__ import annotations

import torch

SHAPES = {
    # Qwen2-7B: 28 layers, 28 query heads, 4 KV heads of 128 -> 57,344 KV bytes/token in bf16.
    "qwen2-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    ),
    # A small Qwen2 for CPU runs: same head layout ratio, 4 layers.
    "qwen2-mini": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
    ),
    # Tiny, for host-side benches (the cache's own work, which does not depend on the model).
    "qwen2-tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
}


def build(shape: str, device: str, dtype: torch.dtype, seed: int = 0):
    """The `shape` model with seeded random weights, built directly in `dtype` on `device` (as
    the server's `--load-format dummy` builds it): built in float32 and then cast, a 7B model
    needed ~45 GB on the way."""
    from transformers import Qwen2Config

    from kvtier.server.devices.model import random_model

    cfg = Qwen2Config(max_position_embeddings=32768, **SHAPES[shape])
    cfg._name_or_path = f"random-{shape}"
    torch.manual_seed(seed)  # what a bench draws after the build stays seeded
    return random_model(cfg, device, dtype, seed)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
