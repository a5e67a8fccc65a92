"""The fused RMSNorm, SiLU-and-multiply and rotary-with-page-write kernels (kvtier/paged/fused.py,
fused_rope.py) against transformers.

On a CUDA device they run compiled; without one, in Triton's CPU interpreter when
TRITON_INTERPRET=1 is set. `make kernels` runs the cases marked `interpret` (the CPU ones, in
fp32 and fp16: the interpreter has bf16 loads but this keeps it to what it computes exactly).
Skipped otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import MODELS

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.interpret,
    pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1"),
]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 80, 3584])
def test_rms_norm_rounds_as_transformers(dtype: torch.dtype, width: int) -> None:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from kvtier.paged.fused import rms_norm

    norm = Qwen2RMSNorm(width, eps=1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    g = torch.Generator(device="cpu").manual_seed(width)
    x = (torch.randn(3, 5, width, generator=g) * 3).to(DEVICE, dtype)
    want = norm(x)
    got = rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.shape == want.shape and got.dtype == want.dtype
    # the same roundings; only the order of the float32 sum of squares differs
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=ulp, atol=ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 1000, 2500])
def test_silu_mul_rounds_as_transformers(dtype: torch.dtype, width: int) -> None:
    from kvtier.paged.fused import silu_mul

    g = torch.Generator(device="cpu").manual_seed(width)
    gate = (torch.randn(7, width, generator=g) * 4).to(DEVICE, dtype)
    up = torch.randn(7, width, generator=g).to(DEVICE, dtype)
    want = torch.nn.functional.silu(gate) * up
    got = silu_mul(gate, up)
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=ulp, atol=ulp)
    with pytest.raises(ValueError, match="differ in shape"):
        silu_mul(gate, up[:, :-1])


def test_empty_rows_are_no_launch() -> None:
    from kvtier.paged.fused import rms_norm, silu_mul

    x = torch.empty(0, 64, device=DEVICE)
    assert rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert silu_mul(x, x).shape == (0, 64)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_fused_model_generates_what_the_model_generates(name: str) -> None:
    """Every norm and MLP of the model swapped (counted), greedy tokens unchanged in fp32."""
    from kvtier.paged.fused import fuse_model

    model = MODELS[name]().to(DEVICE).eval()
    twin = MODELS[name]().to(DEVICE).eval()
    twin.load_state_dict(model.state_dict())
    layers = model.config.num_hidden_layers
    # two norms, an MLP and an attention a layer, the final norm
    assert fuse_model(twin) == 4 * layers + 1
    ids = torch.tensor([[3, 17, 42, 9, 100, 7, 64, 5]], device=DEVICE)
    with torch.inference_mode():
        want = model.generate(ids, max_new_tokens=12, do_sample=False)
        got = twin.generate(ids, max_new_tokens=12, do_sample=False)
        torch.testing.assert_close(twin(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    assert got.tolist() == want.tolist()


# the interpreter casts to bf16 by truncation, so bf16 is checked compiled only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(28, 4, 128), (4, 4, 64), (8, 1, 80)])
def test_rope_write_rounds_as_transformers(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    """The rotated queries and keys are apply_rotary_pos_emb's, bit for bit; keys and values
    land at their slots and nowhere else."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from kvtier.paged.fused_rope import rope_write

    g = torch.Generator(device="cpu").manual_seed(dim)
    tokens, page = 6, 4

    def sample(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 2).to(DEVICE, dtype)

    # q and k as column slices of one projection output, as a fused QKV would hand them over
    qkv = sample(tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    cos, sin = sample(tokens, dim), sample(tokens, dim)
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    k_cache = torch.full((5, page, kv_heads, dim), 7.0, dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, 7.0)
    slots = torch.tensor([9, 2, 17, 0, 3, 12], device=DEVICE)
    got_q, none = rope_write(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert none is None and got_q.is_contiguous()
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    assert torch.equal(flat_k[slots], want_k[0].transpose(0, 1))
    assert torch.equal(flat_v[slots], v)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert bool((flat_k[untouched] == 7).all()) and bool((flat_v[untouched] == 7).all())
    with pytest.raises(ValueError, match="do not fit"):
        rope_write(q, k[:, :, :-2], v, cos, sin, k_cache, v_cache, slots)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_fused_model_steps_through_pages_as_before(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paged steps (prompts, then decode beside a prompt joining) with the fused attention
    forward give the tokens of the model's own forward, and the same pages."""
    from test_paged import _paged, _prompts

    from kvtier.paged import PagedSequence, SeqInput, fused_rope
    from kvtier.paged.fused import fuse_model

    calls = []
    kernel = fused_rope.rope_write
    monkeypatch.setattr(fused_rope, "rope_write", lambda *a: calls.append(1) or kernel(*a))
    runs = []
    for fused in (False, True):
        runner = _paged(name, device=DEVICE, backend="rows", page_size=4)
        if fused:
            assert fuse_model(runner.model) == 4 * runner.model.config.num_hidden_layers + 1
            calls.clear()  # the sample check's own call
        prompts = _prompts(5, [13, 7, 9])
        seqs = [PagedSequence() for _ in prompts]
        outs: list[list[int]] = [[] for _ in prompts]
        logits_seen = []
        for step in range(5):
            items = [(i, prompts[i]) for i in range(3) if step == (0 if i < 2 else 2)]
            items += [(i, [outs[i][-1]]) for i in range(3) if outs[i]]
            logits = runner.step([SeqInput(seqs[i], toks) for i, toks in items])
            logits_seen.append(logits.float().cpu())
            for (i, _), row in zip(items, logits, strict=True):
                outs[i].append(int(row.argmax()))
        runs.append((outs, logits_seen, runner.pool.layer_cache(0)[0].float().cpu()))
    (want, want_logits, want_k), (got, got_logits, got_k) = runs
    assert len(calls) == 5 * runner.model.config.num_hidden_layers  # every layer, every step
    assert got == want
    for a, b in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


def test_fuse_model_swaps_the_kinds_asked_for() -> None:
    """The bench fuses norms and MLPs first, then the attention: each call swaps its kinds."""
    from conftest import MODELS

    from kvtier.paged.fused import fuse_model

    model = MODELS["llama"]().to(DEVICE)
    layers = model.config.num_hidden_layers
    attn = model.model.layers[0].self_attn
    assert fuse_model(model, kinds=("norm", "mlp")) == 3 * layers + 1
    assert "forward" not in vars(attn)  # the class's own
    assert fuse_model(model, kinds=("attention",)) == layers
    assert "forward" in vars(attn)
    with pytest.raises(ValueError, match="unknown fused kinds"):
        fuse_model(model, kinds=("rotary",))


def test_unfuse_model_restores_the_class_forwards() -> None:
    """A process that compares fused and unfused runs (the fleet bench) unfuses between them:
    every swapped module runs its class's forward again, a module fused by something else is
    left alone, and fusing again reuses the merged q/k/v tensor rather than copying it."""
    from conftest import MODELS

    from kvtier.paged.fused import fuse_model, unfuse_model
    from kvtier.paged.fused_rope import _merged_qkv

    model = MODELS["llama"]().to(DEVICE)
    layers = model.config.num_hidden_layers
    ids = torch.tensor([[5, 9, 2, 7]], device=DEVICE)
    with torch.no_grad():
        want = model(ids).logits
    swapped = fuse_model(model)
    assert swapped == 4 * layers + 1
    attn = model.model.layers[0].self_attn
    merged = _merged_qkv(attn)
    other = model.model.layers[1].mlp
    other.forward = lambda x: x  # a forward someone else put there
    assert unfuse_model(model) == swapped - 1
    assert "forward" not in vars(attn) and "forward" in vars(other)
    del other.forward
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
    assert fuse_model(model) == swapped
    again = _merged_qkv(attn)
    assert merged is not None and again is not None and again[0] is merged[0]


def test_merged_qkv_keeps_the_weights_and_lets_go_of_moved_ones() -> None:
    """fuse_model puts q/k/v's weights in one tensor without changing a value or a state_dict
    key; a projection given fresh storage later (a layer moved or reloaded) turns the merged
    GEMM off for that module, and the stale copy is dropped."""
    from conftest import MODELS

    from kvtier.paged.fused import fuse_model
    from kvtier.paged.fused_rope import _merged_qkv
    from kvtier.weights import weights_digest

    model = MODELS["qwen2"]().to(DEVICE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    digest = weights_digest(model)
    fuse_model(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and weights_digest(model) == digest
    assert all(torch.equal(after[k], v) for k, v in before.items())
    attn = model.model.layers[0].self_attn
    merged = _merged_qkv(attn)
    assert merged is not None and merged[1] is not None  # Qwen2's projections have biases
    rows = attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features
    assert merged[0].shape == (rows, attn.q_proj.in_features)
    assert attn.v_proj.weight.untyped_storage().data_ptr() == merged[0].untyped_storage().data_ptr()
    attn.k_proj.weight.data = attn.k_proj.weight.data.clone()
    assert _merged_qkv(attn) is None and attn.kvtier_qkv is None
    assert _merged_qkv(model.model.layers[1].self_attn) is not None


def test_an_attention_with_another_rotary_is_left_alone() -> None:
    """An attention module whose file's apply_rotary_pos_emb rotates interleaved pairs (as
    GPT-J's) fails the sample check and keeps its own forward; one with a query norm (as
    Qwen3's) is not taken at all."""
    import sys
    import types as pytypes

    from conftest import MODELS

    from kvtier.paged.fused import fuse_model
    from kvtier.paged.fused_rope import attention_width

    model = MODELS["qwen2"]().to(DEVICE)
    attn = model.model.layers[0].self_attn
    assert attention_width(attn) == model.config.hidden_size

    def interleaved(q, k, cos, sin):  # type: ignore[no-untyped-def]
        def rot(x):  # type: ignore[no-untyped-def]
            return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)

        return q * cos[:, None] + rot(q) * sin[:, None], k * cos[:, None] + rot(k) * sin[:, None]

    module = pytypes.ModuleType("gptj_like")
    module.apply_rotary_pos_emb = interleaved  # type: ignore[attr-defined]
    sys.modules["gptj_like"] = module
    try:
        other = type("GPTJLikeAttention", (type(attn),), {"__module__": "gptj_like"})
        attn.__class__ = other
        forward = attn.forward
        fuse_model(model.model.layers[0])
        assert attn.forward == forward
    finally:
        del sys.modules["gptj_like"]
    attn.q_norm = torch.nn.Identity()
    assert attention_width(attn) is None


def test_a_norm_that_computes_something_else_is_left_alone() -> None:
    """A class named like an RMSNorm whose forward is not transformers' (here `1 + weight`,
    as Gemma's) fails the sample check and keeps its own forward."""
    from kvtier.paged.fused import fuse_model

    class OffsetRMSNorm(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(width))
            self.variance_epsilon = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            var = x.float().pow(2).mean(-1, keepdim=True)
            return (x.float() * torch.rsqrt(var + self.variance_epsilon) * (1 + self.weight)).to(
                x.dtype
            )

    block = torch.nn.Sequential(OffsetRMSNorm(32)).to(DEVICE)
    forward = block[0].forward
    assert fuse_model(block) == 0
    assert block[0].forward == forward
