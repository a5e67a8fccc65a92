"""Small transformers models built from configs with random weights (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch


def tiny_llama(seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
    )
    return LlamaForCausalLM(cfg).eval().to(torch.float32)


def tiny_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=4096,
    )
    return Qwen2ForCausalLM(cfg).eval().to(torch.float32)


MODELS = {"llama": tiny_llama, "qwen2": tiny_qwen2}


@pytest.fixture(params=sorted(MODELS))
def model(request: pytest.FixtureRequest):
    return MODELS[request.param]()
