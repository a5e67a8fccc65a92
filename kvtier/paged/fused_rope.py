"""Rotary embedding and the page write as one kernel: the attention half of `fuse_model`.

transformers' Llama-style attention rotates the new queries and keys with `apply_rotary_pos_emb`
(per tensor a multiply, a half rotation built from a slice, a negation and a concatenation, a
second multiply and a sum: about five kernels each for queries and keys), and the paged
attention function then writes the keys and values into the pool (`index_copy_`, two more). In
a CUDA graph of a decode step that is a dozen small kernels a layer, each paying its launch
gap. `rope_write` does all of it in one launch: a program per (token, head) rotates that
head's query into a fresh `[T, heads, dim]` tensor, or rotates its key and stores key and value
at the token's slot of the layer's pages.

`attention_forward` replaces the forward of an attention module whose structure is the one
this kernel assumes (`q_proj`/`k_proj`/`v_proj`/`o_proj`, no query or key norm, no logit
softcap, no sliding window) and whose own module's `apply_rotary_pos_emb` gives the kernel's
result on a sample (`rope_agrees`). It takes the fused path only inside a paged forward
(`kvtier.paged.context`) over pages that are not int8; anywhere else it calls the module's own
forward. `merge_qkv` makes the query, key and value projections one GEMM there: their weights
become row ranges of one tensor (the three small launches of a decode step, K's and V's a
fraction of Q's, cost more than their bytes).

Exactness: the kernel rounds where transformers rounds (each product and the sum to the
input's dtype), so the rotated values are the ones `apply_rotary_pos_emb` gives, bit for bit.
The merged GEMM computes the same dot products; cuBLAS may pick another kernel for its width,
so bf16 results agree within the fused kernels' tolerance, fp32 ones exactly in the tests.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import triton
import triton.language as tl

from kvtier.paged.attention import attend
from kvtier.paged.context import ATTN_NAME, PagedContext, current_context


@triton.jit
def _rope_write_kernel(
    Q, K, V, COS, SIN, QOUT, KC, VC, SLOTS,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc_t, ss_t, so_t, so_h, skc_s, skc_h, svc_s, svc_h,
    HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    m = d < HALF
    cos1 = tl.load(COS + t * sc_t + d, mask=m, other=0.0).to(tl.float32)
    cos2 = tl.load(COS + t * sc_t + HALF + d, mask=m, other=0.0).to(tl.float32)
    sin1 = tl.load(SIN + t * ss_t + d, mask=m, other=0.0).to(tl.float32)
    sin2 = tl.load(SIN + t * ss_t + HALF + d, mask=m, other=0.0).to(tl.float32)
    slot = tl.load(SLOTS + t).to(tl.int64)  # read by every program: one value per token
    if h < HEADS:
        src = Q + t * sq_t + h * sq_h
        dst = QOUT + t * so_t + h * so_h
    else:
        src = K + t * sk_t + (h - HEADS) * sk_h
        dst = KC + slot * skc_s + (h - HEADS) * skc_h
    x1 = tl.load(src + d, mask=m, other=0.0)
    x2 = tl.load(src + HALF + d, mask=m, other=0.0)
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q2, q1): each op rounded as torch's
    lo = (a1 * cos1).to(dtype).to(tl.float32) + (-a2 * sin1).to(dtype).to(tl.float32)
    hi = (a2 * cos2).to(dtype).to(tl.float32) + (a1 * sin2).to(dtype).to(tl.float32)
    out_ty = dst.dtype.element_ty
    tl.store(dst + d, lo.to(dtype).to(out_ty), mask=m)
    tl.store(dst + HALF + d, hi.to(dtype).to(out_ty), mask=m)
    if h >= HEADS:  # the value, unrotated, beside its key
        vsrc = V + t * sv_t + (h - HEADS) * sv_h
        vdst = VC + slot * svc_s + (h - HEADS) * svc_h
        w1 = tl.load(vsrc + d, mask=m, other=0.0)
        w2 = tl.load(vsrc + HALF + d, mask=m, other=0.0)
        tl.store(vdst + d, w1.to(vdst.dtype.element_ty), mask=m)
        tl.store(vdst + HALF + d, w2.to(vdst.dtype.element_ty), mask=m)


def rope_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate `q` `[T, heads, dim]` and `k` `[T, kv_heads, dim]` by `cos`/`sin` `[T, dim]`
    (transformers' `apply_rotary_pos_emb`); store the rotated keys and `v` at `slot_mapping`'s
    flat slots of `k_cache`/`v_cache` `[pages, page_size, kv_heads, dim]`. Returns the rotated
    queries (contiguous) and, where no caches are given, the rotated keys (a `[T, kv_heads,
    dim]` tensor written as a cache of one-token pages: the sample check's path)."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if dim % 2 or k.shape != (tokens, kv_heads, dim) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if cos.shape != (tokens, dim) or sin.shape != (tokens, dim):
        raise ValueError(f"cos/sin {tuple(cos.shape)} are not [{tokens}, {dim}]")
    for name, x in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
    keys = None
    if k_cache is None or v_cache is None or slot_mapping is None:  # keys out, values dropped
        keys = torch.empty(tokens, 1, kv_heads, dim, dtype=k.dtype, device=k.device)
        k_cache, v_cache = keys, torch.empty_like(keys)
        slot_mapping = torch.arange(tokens, device=k.device)
    q_out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    if tokens:
        kc = k_cache.view(-1, *k_cache.shape[2:])  # flat slots
        vc = v_cache.view(-1, *v_cache.shape[2:])
        _rope_write_kernel[(tokens, heads + kv_heads)](
            q, k, v, cos, sin, q_out, kc, vc, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
            kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
            HEADS=heads, HALF=dim // 2, BLOCK=triton.next_power_of_2(dim // 2),
            enable_fp_fusion=False,  # no fused multiply-add: each product rounds as torch's
        )  # fmt: skip
    return q_out, None if keys is None else keys[:, 0]


def attention_width(module: torch.nn.Module) -> int | None:
    """The input width of an attention module whose forward `attention_forward` can stand in
    for (see the module docstring); None for any other module."""
    projections = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    config = getattr(module, "config", None)
    if not (
        type(module).__name__.endswith("Attention")
        and all(isinstance(p, torch.nn.Linear) for p in projections)
        and isinstance(getattr(module, "head_dim", None), int)
        and isinstance(getattr(module, "scaling", None), float)
        and isinstance(getattr(module, "layer_idx", None), int)
        and getattr(module, "sliding_window", None) is None
        and getattr(module, "q_norm", None) is None
        and getattr(module, "k_norm", None) is None
        and getattr(config, "attn_logit_softcapping", None) is None
        and _rotary_of(module) is not None
    ):
        return None
    return int(projections[0].in_features)  # type: ignore[union-attr]


def _rotary_of(module: torch.nn.Module) -> Any:
    """The `apply_rotary_pos_emb` of the module's own transformers file, if it has one."""
    return getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)


def rope_agrees(module: Any) -> bool:
    """Whether the kernel rotates a sample as the module's `apply_rotary_pos_emb` does (the
    module's dtype and device; a half-rotation rotary passes, an interleaved one does not)."""
    param = next(module.parameters())
    dim, tokens = int(module.head_dim), 3
    heads, kv_heads = module.q_proj.out_features // dim, module.k_proj.out_features // dim
    gen = torch.Generator(device="cpu").manual_seed(0)

    def sample(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(param.device, param.dtype)

    q, k, v = (
        sample(tokens, heads, dim),
        sample(tokens, kv_heads, dim),
        sample(tokens, kv_heads, dim),
    )
    cos, sin = sample(tokens, dim), sample(tokens, dim)
    with torch.inference_mode():
        want_q, want_k = _rotary_of(module)(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
        )
        got_q, got_k = rope_write(q, k, v, cos, sin, None, None, None)
    assert got_k is not None  # no caches given: the keys come back
    tol = 1e-5 if param.dtype == torch.float32 else 2e-2
    return all(
        torch.allclose(got.float(), want[0].transpose(0, 1).float(), rtol=tol, atol=tol)
        for got, want in ((got_q, want_q), (got_k, want_k))
    )


def attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention module's forward inside a paged step: projections, then one kernel for
    the rotary embedding and the page write, then the paged attention and the output
    projection. Anywhere else (another attention implementation, no paged context, int8
    pages, a layer on another device than the step's buffers) the module's own forward."""
    ctx = _fused_context(self, hidden_states, position_embeddings)
    if ctx is None or position_embeddings is None:
        return type(self).forward(
            self,
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **kwargs,
        )
    tokens = hidden_states.shape[1]
    x = hidden_states[0]
    merged = _merged_qkv(self)
    if merged is not None:  # one GEMM; q, k and v are column ranges of its output
        weight, bias = merged
        sizes = (self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features)
        q, k, v = torch.nn.functional.linear(x, weight, bias).split(sizes, dim=-1)
    else:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    q, k, v = (t.view(tokens, -1, self.head_dim) for t in (q, k, v))
    cos, sin = position_embeddings
    k_cache, v_cache = ctx.pool.layer_cache(self.layer_idx)
    q, _ = rope_write(q, k, v, cos[0], sin[0], k_cache, v_cache, ctx.slot_mapping)
    out = attend(ctx, q, k_cache, v_cache, self.scaling)
    return self.o_proj(out.reshape(1, tokens, -1)), None


def merge_qkv(module: Any) -> bool:
    """Put the weights (and biases) of the module's q, k and v projections in one tensor each,
    the projections' parameters becoming row ranges of it (no memory added), so that
    `attention_forward` computes all three in one GEMM. False (nothing changed) where their
    dtypes, devices or biases differ. A module merged already keeps its tensor (no copy)."""
    if _merged_qkv(module) is not None:
        return True
    projections = (module.q_proj, module.k_proj, module.v_proj)
    weights = [p.weight for p in projections]
    biases = [p.bias for p in projections]
    if len({(w.dtype, w.device) for w in weights}) != 1 or len({b is None for b in biases}) != 1:
        return False
    with torch.no_grad():
        weight = torch.cat(weights)
        bias = None if biases[0] is None else torch.cat(biases)
        start = 0
        for p in projections:
            end = start + p.out_features
            p.weight.data = weight[start:end]  # the same Parameter, its data a view
            if bias is not None:
                p.bias.data = bias[start:end]
            start = end
    module.kvtier_qkv = (weight, bias)  # not registered: state_dict keeps the three
    return True


def _merged_qkv(module: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The merged q/k/v weight and bias where the projections' parameters are still views of
    them; None where they are not (never merged, or given fresh storage since: a layer moved
    or reloaded by `kvtier.placement`), and the projections then run one by one."""
    merged = getattr(module, "kvtier_qkv", None)
    if merged is None:
        return None
    storage = merged[0].untyped_storage().data_ptr()
    for p in (module.q_proj, module.k_proj, module.v_proj):
        if p.weight.untyped_storage().data_ptr() != storage:
            module.kvtier_qkv = None  # drop the stale copy
            return None
    return merged


def _fused_context(
    module: Any, hidden_states: torch.Tensor, position_embeddings: Any
) -> PagedContext | None:
    """The paged step's context where the fused path can run this call, else None."""
    implementation = module.config._attn_implementation  # noqa: SLF001  # no public getter
    if (
        position_embeddings is None
        or implementation != ATTN_NAME
        or hidden_states.shape[0] != 1
        or not (hidden_states.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    ):
        return None
    ctx = current_context()
    if ctx.pool.quantized or ctx.slot_mapping.device != hidden_states.device:
        return None
    return ctx
