"""The fused RMSNorm and SiLU-and-multiply kernels (kvtier/paged/fused.py) against transformers.

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
    assert fuse_model(twin) == 3 * layers + 1  # two norms and an MLP a layer, the final norm
    ids = torch.tensor([[3, 17, 42, 9, 100, 7, 64, 5]], device=DEVICE)
    with torch.inference_mode():
        want = model.generate(ids, max_new_tokens=12, do_sample=False)
        got = twin.generate(ids, max_new_tokens=12, do_sample=False)
        torch.testing.assert_close(twin(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    assert got.tolist() == want.tolist()


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
