"""`kvtier.integrations.hf.generate` hands the model its cache under the name the installed
transformers takes (`cache`; `past_key_values` in older releases), so no FutureWarning."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

import torch
from conftest import tiny_llama

from kvtier import CacheConfig, TieredCache
from kvtier.integrations import hf


def test_cache_kwarg_is_the_name_forward_takes() -> None:
    model = tiny_llama()
    name = hf.cache_kwarg(model)
    assert name in inspect.signature(type(model).forward).parameters
    if "cache" in inspect.signature(type(model).forward).parameters:
        assert name == "cache"

    class OlderRelease(torch.nn.Module):  # the signature of releases before the rename
        def forward(self, input_ids: torch.Tensor, past_key_values: object = None) -> None: ...

    assert hf.cache_kwarg(OlderRelease()) == "past_key_values"


def test_generate_twice_without_deprecation_warnings(tmp_path: Path) -> None:
    model = tiny_llama()
    cfg = CacheConfig(
        l3_root=tmp_path, l1_bytes=16 << 20, l2_bytes=8 << 20, chunk_tokens=16, pin_memory=False
    )
    cache = TieredCache(cfg, model)
    ids = torch.tensor([[5, 9, 13, 2] * 10])
    kw: dict[str, Any] = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            out = hf.generate(model, cache, "s", ids, **kw)
            again = torch.cat([out, torch.tensor([[7, 3]])], 1)
            out2 = hf.generate(model, cache, "s", again, **kw)
        assert out2.shape[1] == again.shape[1] + 4
        assert torch.equal(out2[:, : again.shape[1]], again)
    finally:
        cache.close()
