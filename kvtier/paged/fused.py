"""Fused elementwise kernels for the batched step: RMSNorm, SiLU-and-multiply (Triton), and
(`kvtier.paged.fused_rope`) the rotary embedding with the page write.

A transformers decoder layer's RMSNorm runs as five or six kernels (a cast up, a square, a
mean, rsqrt, two multiplies and a cast down) and its MLP's activation as two (SiLU, then the
product with the up projection). In a CUDA graph each small kernel still costs a few
microseconds of GPU time; at a batch of 64 they add up to a fifth of a decode step (the
"other kernels" of `bench/paged_step.py --breakdown`). `fuse_model` swaps the forward of every
RMSNorm and gated-SiLU MLP module of a model for one kernel each.

Exactness: each kernel rounds where transformers rounds. The norm computes in float32, casts
the normalized row to the input's dtype, then multiplies by the weight (rounded again); the
activation rounds SiLU's result to the input's dtype before the product. Only the order of the
float32 sum of squares differs. `fuse_model` checks every module class on a sample before it
swaps it, and leaves a class whose forward computes something else (Gemma's `1 + weight`
norm, say) as it is.

CUDA in production; on the CPU the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`),
which is how `make kernels` tests them.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)


@triton.jit
def _rms_norm_kernel(X, W, OUT, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(G, U, OUT, stride_g, stride_u, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (act * u).to(OUT.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as rows of its last dimension, contiguous along it."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (`weight * (x / rms(x)).to(x.dtype)`) in one kernel."""
    x2 = _rows(x)
    n = x2.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, out, x2.stride(0), out.stride(0), n, float(eps), BLOCK=block
        )
    return out.view(*x.shape[:-1], n)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` in one kernel, rounded as the two torch operations round."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    g2, u2 = _rows(gate), _rows(up)
    n = g2.shape[-1]
    out = torch.empty(g2.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if g2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        grid = (g2.shape[0], triton.cdiv(n, block))
        _silu_mul_kernel[grid](
            g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), n, BLOCK=block
        )
    return out.view(*gate.shape[:-1], n)


def _norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _norm_width(module: torch.nn.Module) -> int | None:
    """The width of a transformers-style RMSNorm (`weight`, `variance_epsilon`); None if
    `module` is none."""
    weight = getattr(module, "weight", None)
    if (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    ):
        return int(weight.shape[0])
    return None


def _mlp_width(module: torch.nn.Module) -> int | None:
    """The input width of a gated MLP whose activation is SiLU (torch's, or transformers'
    `SiLUActivation`); None if `module` is none."""
    act = getattr(module, "act_fn", None)
    gate = getattr(module, "gate_proj", None)
    projections = (gate, getattr(module, "up_proj", None), getattr(module, "down_proj", None))
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
    linear = all(isinstance(p, torch.nn.Linear) for p in projections)
    return int(gate.in_features) if silu and linear and isinstance(gate, torch.nn.Linear) else None


def _agrees(module: torch.nn.Module, fused: Any, width: int) -> bool:
    """Whether the fused forward gives the module's own result on a sample (its dtype)."""
    param = next(module.parameters())
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4, width, generator=gen).to(param.device, param.dtype)
    with torch.inference_mode():
        want = module(x)
        got = fused(module, x)
    tol = 1e-5 if param.dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol))


KINDS = ("norm", "mlp", "attention")


def fuse_model(model: torch.nn.Module, kinds: tuple[str, ...] = KINDS) -> int:
    """Swap the forward of the model's RMSNorm ("norm") and gated-SiLU MLP ("mlp") modules for
    the fused kernels, and of its Llama-style attention modules ("attention") for one whose
    rotary embedding and page write are one kernel and whose q/k/v projections one GEMM
    (`kvtier.paged.fused_rope`); the number of modules swapped. A module class whose forward
    the sample check does not confirm keeps its own (logged once)."""
    from kvtier.paged.fused_rope import attention_forward, attention_width, merge_qkv, rope_agrees

    if unknown := set(kinds) - set(KINDS):
        raise ValueError(f"unknown fused kinds {sorted(unknown)}: choose from {KINDS}")
    verdict: dict[tuple[type, str], bool] = {}
    swapped = 0
    for module in model.modules():
        fused: Callable[..., Any]
        if (width := _norm_width(module)) is not None:
            kind, fused = "norm", _norm_forward
        elif (width := _mlp_width(module)) is not None:
            kind, fused = "mlp", _mlp_forward
        elif attention_width(module) is not None:
            kind, fused = "attention", attention_forward
        else:
            continue
        if kind not in kinds:
            continue
        key = (type(module), kind)
        if key not in verdict:
            if kind == "attention":
                verdict[key] = rope_agrees(module)
            else:
                verdict[key] = _agrees(module, fused, width)  # type: ignore[arg-type]
            if not verdict[key]:
                log.info(
                    "%s computes something else than the fused %s: left as it is",
                    key[0].__name__,
                    kind,
                )
        if verdict[key]:
            module.forward = types.MethodType(fused, module)  # type: ignore[method-assign]
            swapped += 1
            if kind == "attention":
                merge_qkv(module)
    return swapped


def fused_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's modules whose forward `fuse_model` swapped."""
    from kvtier.paged.fused_rope import attention_forward

    ours = {_norm_forward, _mlp_forward, attention_forward}
    return [m for m in model.modules() if getattr(vars(m).get("forward"), "__func__", None) in ours]


def unfuse_model(model: torch.nn.Module) -> int:
    """Undo `fuse_model`: every module it swapped runs its class's forward again; the number
    of modules restored. Merged q/k/v weights stay merged (the projections are views of one
    tensor, which the class's forward reads as it would three), so a later `fuse_model` merges
    nothing again. For a process that compares fused and unfused runs of one model."""
    swapped = fused_modules(model)
    for module in swapped:
        del module.forward
    return len(swapped)
