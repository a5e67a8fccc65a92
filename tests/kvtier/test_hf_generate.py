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


def test_extend_appends_every_layer_as_update_does_and_grows_the_block(tmp_path: Path) -> None:
    """`KvtierCache.extend` (the batch's commit path: one copy into the session's L1 block)
    leaves the same K/V and lengths as `update` layer by layer, growing past the capacity."""
    model = tiny_llama()
    cfg = CacheConfig(
        l3_root=tmp_path, l1_bytes=16 << 20, l2_bytes=8 << 20, chunk_tokens=16, pin_memory=False
    )
    cache = TieredCache(cfg, model)
    try:
        ids = list(range(3, 23))  # 20 tokens: 19 restored (nothing cached), capacity 32
        a = cache.session("a").restore(ids)
        b = cache.session("b").restore(ids)
        n_layers = len(a.layers)
        heads, dim = a.layers[0].keys.shape[1], a.layers[0].keys.shape[3]
        for n in (19, 30):  # the second passes the 32-token capacity: the block grows
            new = torch.randn(n_layers, 2, 1, heads, n, dim)
            start = a.get_seq_length()
            a.extend(new)
            for i in range(n_layers - 1, -1, -1):
                b.update(new[i, 0], new[i, 1], i)
            for i in range(n_layers):
                assert a.layers[i].keys.shape[2] == start + n == b.layers[i].keys.shape[2]
                assert torch.equal(a.layers[i].keys, b.layers[i].keys)
                assert torch.equal(a.layers[i].values, b.layers[i].values)
                assert torch.equal(a.layers[i].keys[0, :, start:], new[i, 0, 0])
        assert a.owner.bufs.block is not None  # the one-copy path was taken
        a.layers[1].crop(-1)  # layers of different lengths: update, layer by layer
        one = torch.randn(n_layers, 2, 1, heads, 1, dim)
        a.extend(one)
        assert a.owner.lengths[0] == 50 and a.owner.lengths[1] == 49
        assert torch.equal(a.layers[1].keys[0, :, -1], one[1, 0, 0, :, 0])
    finally:
        cache.close()


def test_append_kv_takes_copy_outs_tensor_into_any_cache(tmp_path: Path) -> None:
    """`pagecopy.append_kv`: a kvtier session's Cache takes `copy_out`'s tensor whole, and a
    plain DynamicCache gets the same K/V layer by layer."""
    from transformers import DynamicCache

    from kvtier.server.pages.pagecopy import append_kv

    model = tiny_llama()
    cfg = CacheConfig(
        l3_root=tmp_path, l1_bytes=16 << 20, l2_bytes=8 << 20, chunk_tokens=16, pin_memory=False
    )
    cache = TieredCache(cfg, model)
    try:
        kv = cache.session("a").restore(list(range(3, 13)))
        n_layers = len(kv.layers)
        heads, dim = kv.layers[0].keys.shape[1], kv.layers[0].keys.shape[3]
        new = torch.randn(n_layers, 2, 1, heads, 5, dim)
        plain = DynamicCache()
        append_kv(kv, new)
        append_kv(plain, new)
        for i in range(n_layers):
            assert torch.equal(kv.layers[i].keys, new[i, 0])
            assert torch.equal(plain.layers[i].keys, new[i, 0])
            assert torch.equal(plain.layers[i].values, new[i, 1])
    finally:
        cache.close()
