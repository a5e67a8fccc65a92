"""Cold-tier codecs: exact round trips, error bounds, and the quality cost on a trained model."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from kvtier.codecs import CODEC_IDS, make_codec
from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.integrations.hf import cache_kwarg

GQA = KVGeometry(3, 2, 16, 16, "bfloat16", "gqa")
MLA = KVGeometry(2, 1, 24, 0, "float16", "mla")


def _chunk(g: KVGeometry, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(g.chunk_shape(n), generator=gen).to(g.torch_dtype())


@pytest.mark.parametrize("geometry", [GQA, MLA, KVGeometry(2, 4, 8, 8, "float32", "mha")])
@pytest.mark.parametrize("name", ["native", "int8", "fp8"])
@pytest.mark.parametrize("ntokens", [1, 7, 32])
def test_round_trip_shapes_and_sizes(geometry: KVGeometry, name: str, ntokens: int) -> None:
    codec = make_codec(name, geometry)
    chunk = _chunk(geometry, ntokens)
    payload = codec.encode(chunk)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == codec.payload_bytes(ntokens)
    back = codec.decode(payload, ntokens)
    assert back.shape == chunk.shape and back.dtype == chunk.dtype
    if name == "native":
        assert torch.equal(back.view(torch.uint8), chunk.view(torch.uint8))
        assert codec.payload_bytes(ntokens) == geometry.chunk_bytes(ntokens)
    elif ntokens >= 32:  # per-channel K scales cost more than they save on tiny chunks
        assert codec.payload_bytes(ntokens) < geometry.chunk_bytes(ntokens)


def test_native_is_bit_exact_including_special_values() -> None:
    chunk = _chunk(GQA, 5)
    chunk[0, 0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    codec = make_codec("native", GQA)
    back = codec.decode(codec.encode(chunk).clone(), 5)
    assert torch.equal(back.view(torch.int16), chunk.view(torch.int16))


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantization_error_is_bounded_by_the_scale(name: str) -> None:
    g = KVGeometry(2, 2, 16, 16, "float32", "gqa")
    chunk = _chunk(g, 16)
    codec = make_codec(name, g)
    back = codec.decode(codec.encode(chunk), 16)
    k, v = chunk[:, 0], chunk[:, 1]
    k_step = k.abs().amax(dim=1, keepdim=True) / 127
    v_step = v.abs().amax(dim=-1, keepdim=True) / 127
    if name == "int8":  # rounding to the nearest step: at most half a step off
        assert ((back[:, 0] - k).abs() <= k_step / 2 + 1e-6).all()
        assert ((back[:, 1] - v).abs() <= v_step / 2 + 1e-6).all()
    else:  # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 above the subnormal range
        big = chunk.abs() > chunk.abs().amax() / 64
        rel = ((back - chunk).abs() / chunk.abs().clamp(min=1e-12))[big]
        assert rel.max() <= 2**-4 + 1e-6


def test_k_scales_are_per_channel_and_v_scales_per_token() -> None:
    g = KVGeometry(1, 1, 8, 8, "float32", "mha")
    chunk = _chunk(g, 16) * 0.01
    chunk[0, 0, :, 0, 3] *= 1000  # an outlier channel in K
    chunk[0, 1, 5] *= 1000  # an outlier token in V
    codec = make_codec("int8", g)
    back = codec.decode(codec.encode(chunk), 16)
    err = (back - chunk).abs()
    others_k = torch.ones(8, dtype=torch.bool)
    others_k[3] = False
    assert err[0, 0, :, 0][:, others_k].max() < 0.01 * 4 / 127  # untouched by the outlier
    others_v = torch.ones(16, dtype=torch.bool)
    others_v[5] = False
    assert err[0, 1][others_v].max() < 0.01 * 4 / 127


def test_zeros_and_out_buffers() -> None:
    for name in ("native", "int8", "fp8"):
        codec = make_codec(name, GQA)
        zeros = torch.zeros(GQA.chunk_shape(4), dtype=torch.bfloat16)
        out = torch.full((codec.payload_bytes(4) + 100,), 7, dtype=torch.uint8)
        payload = codec.encode(zeros, out=out)
        assert payload.data_ptr() == out.data_ptr()
        dst = torch.full(GQA.chunk_shape(4), 3.0, dtype=torch.bfloat16)
        assert codec.decode(out, 4, out=dst).data_ptr() == dst.data_ptr()
        assert torch.equal(dst, zeros)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_scratch_gives_the_same_bytes_and_is_checked(name: str) -> None:
    codec = make_codec(name, GQA)
    chunk = _chunk(GQA, 32, seed=4)
    scratch = torch.full((codec.scratch_elems(32) + 3,), float("nan"))  # stale contents
    payload = codec.encode(chunk, scratch=scratch)
    assert torch.equal(payload, codec.encode(chunk))
    back = codec.decode(payload, 32, scratch=scratch)
    assert torch.equal(back, codec.decode(payload, 32))
    with pytest.raises(ConfigError, match="scratch_elems"):
        codec.encode(chunk, scratch=torch.zeros(codec.scratch_elems(32) - 1))
    with pytest.raises(ConfigError, match="float32"):
        codec.decode(payload, 32, scratch=torch.zeros(codec.scratch_elems(32), dtype=torch.half))
    assert make_codec("native", GQA).scratch_elems(32) == 0


def test_payload_inside_a_larger_buffer_at_an_odd_offset() -> None:
    codec = make_codec("int8", GQA)
    chunk = _chunk(GQA, 3)
    payload = codec.encode(chunk)
    raw = torch.zeros(payload.numel() + 1, dtype=torch.uint8)
    raw[1:] = payload
    assert torch.equal(codec.decode(raw[1:], 3), codec.decode(payload, 3))


def test_bad_input_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown codec 'zstd'"):
        make_codec("zstd", GQA)
    codec = make_codec("int8", GQA)
    with pytest.raises(ConfigError, match="chunk shape"):
        codec.encode(torch.zeros(3, 2, 4, 2, 8, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match="dtype"):
        codec.encode(torch.zeros(GQA.chunk_shape(4), dtype=torch.float32))
    with pytest.raises(ConfigError, match="at least"):
        codec.decode(torch.zeros(10, dtype=torch.uint8), 4)
    with pytest.raises(ConfigError, match="equal dims"):
        make_codec("native", KVGeometry(1, 1, 8, 4, "float16", "mha"))


def test_params_name_the_codec() -> None:
    ids = {make_codec(n, GQA).params()[1] for n in CODEC_IDS}
    assert ids == set(CODEC_IDS.values())


# ---- quality cost on a trained model --------------------------------------------------------

CONTEXT = 256  # tokens whose KV goes through the codec (two 128-token chunks)
POSITIONS = 512  # continuation positions scored against the exact cache
CHUNK_TOKENS = 128
TRAIN_STEPS = 200  # a fixed count, not a time budget: the same model on any machine


def _corpus(rng: random.Random, nbytes: int) -> bytes:
    """Structured text a tiny model can learn: sums, counts and a small grammar."""
    names = ["ana", "bo", "cy", "dee", "eli", "fox"]
    verbs = ["sees", "calls", "helps", "finds"]
    parts: list[str] = []
    size = 0
    while size < nbytes:
        kind = rng.randrange(3)
        if kind == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            s = f"{a}+{b}={a + b}; "
        elif kind == 1:
            start = rng.randrange(50)
            s = "count " + " ".join(str(start + i) for i in range(rng.randrange(3, 7))) + ". "
        else:
            s = f"{rng.choice(names)} {rng.choice(verbs)} {rng.choice(names)}. "
        parts.append(s)
        size += len(s)
    return "".join(parts).encode()[:nbytes]


def _train(steps: int = TRAIN_STEPS) -> torch.nn.Module:
    """A 2-layer byte-level Llama trained for a fixed number of seeded steps (about 15 s on one
    core): deterministic, so its quality does not depend on how busy the machine is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    data = torch.tensor(list(_corpus(random.Random(1), 200_000)), dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    # Sequences as long as the evaluation's (CONTEXT + POSITIONS): rope must have seen them.
    batch, seq = 2, CONTEXT + POSITIONS
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, 2.0 * (1 - s / steps)))
    gen = torch.Generator().manual_seed(2)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[i : i + seq] for i in idx.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    return model


def _apply_codec(
    cache: object, name: str, geometry: KVGeometry, chunk_tokens: int = CHUNK_TOKENS
) -> None:
    """Send every layer's K and V through the codec chunk by chunk, as L2/L3 would."""
    codec = make_codec(name, geometry)
    layers = cache.layers  # type: ignore[attr-defined]
    total = layers[0].keys.shape[2]
    for start in range(0, total, chunk_tokens):
        n = min(chunk_tokens, total - start)
        chunk = torch.stack(
            [
                torch.stack(
                    [
                        layer.keys[0, :, start : start + n].transpose(0, 1),
                        layer.values[0, :, start : start + n].transpose(0, 1),
                    ]
                )
                for layer in layers
            ]
        )
        back = codec.decode(codec.encode(chunk), n)
        for i, layer in enumerate(layers):
            layer.keys[0, :, start : start + n] = back[i, 0].transpose(0, 1)
            layer.values[0, :, start : start + n] = back[i, 1].transpose(0, 1)


def measure_quality(model: torch.nn.Module, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per codec: attention-output relative error, greedy agreement, perplexity change."""
    from transformers import DynamicCache

    net: Any = model.to(torch.bfloat16)  # a LlamaForCausalLM (typed as a Module)
    geometry = KVGeometry.from_config(net.config, dtype="bfloat16")
    text = _corpus(random.Random(99), CONTEXT + POSITIONS + 1)
    ids = torch.tensor([list(text)], dtype=torch.long)
    prefix, cont, target = ids[:, :CONTEXT], ids[:, CONTEXT:-1], ids[:, CONTEXT + 1 :]
    attn_out: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.register_forward_hook(lambda _m, _i, out: attn_out.append(out[0].float()))
        for layer in net.model.layers
    ]
    results: dict[str, dict[str, float]] = {}
    try:
        with torch.no_grad():
            runs = {}
            for name in ("exact", *names):
                cache = DynamicCache(config=net.config)
                net(input_ids=prefix, **{cache_kwarg(net): cache}, use_cache=True)
                if name != "exact":
                    _apply_codec(cache, name, geometry)
                attn_out.clear()
                logits = net(input_ids=cont, **{cache_kwarg(net): cache}, use_cache=True).logits
                runs[name] = (logits.float(), list(attn_out))
        ref_logits, ref_attn = runs["exact"]
        ref_nll = torch.nn.functional.cross_entropy(ref_logits[0], target[0])
        for name in names:
            logits, attn = runs[name]
            errs = [float((a - r).norm() / r.norm()) for a, r in zip(attn, ref_attn, strict=True)]
            nll = torch.nn.functional.cross_entropy(logits[0], target[0])
            results[name] = {
                "attn_rel_err_mean": sum(errs) / len(errs),
                "attn_rel_err_max": max(errs),
                "greedy_agreement": float(
                    (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()
                ),
                "ppl_exact": math.exp(float(ref_nll)),
                "ppl": math.exp(float(nll)),
                "ppl_change": math.exp(float(nll)) / math.exp(float(ref_nll)) - 1.0,
            }
    finally:
        for hook in hooks:
            hook.remove()
    return results


@pytest.mark.slow
def test_codec_quality_on_a_trained_tiny_llama() -> None:
    # One thread: on 2 busy cores, OpenMP's barriers made each step 30x slower with two.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _train()
        results = measure_quality(model, ("native", "int8", "fp8"))
    finally:
        torch.set_num_threads(threads)
    print("\ncodec   attn rel err (mean/max)   greedy agreement   ppl exact -> codec (change)")
    for name, r in results.items():
        print(
            f"{name:7} {r['attn_rel_err_mean']:.5f} / {r['attn_rel_err_max']:.5f}"
            f"        {r['greedy_agreement']:.4f}          "
            f"{r['ppl_exact']:.4f} -> {r['ppl']:.4f} ({r['ppl_change']:+.4%})"
        )
    assert results["native"]["ppl_exact"] < 4.0, "the tiny model did not learn the corpus"
    native = results["native"]
    assert native["attn_rel_err_max"] == 0.0 and native["greedy_agreement"] == 1.0
    assert native["ppl_change"] == 0.0
    int8, fp8 = results["int8"], results["fp8"]
    assert int8["attn_rel_err_mean"] < 0.05 and int8["greedy_agreement"] >= 0.97
    assert abs(int8["ppl_change"]) < 0.02
    assert fp8["attn_rel_err_mean"] < 0.10 and fp8["greedy_agreement"] >= 0.93
    assert abs(fp8["ppl_change"]) < 0.05
    assert int8["attn_rel_err_mean"] < fp8["attn_rel_err_mean"]
