"""bench/paged_step.py's kernel kinds: which CUDA kernels `--breakdown` counts as what."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from paged_step import kernel_kind


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "matmul"),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "matmul"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "matmul"),
        ("_partial_kernel", "attention"),
        ("_reduce_kernel", "attention"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>", "other"),
        ("Memcpy HtoD (Pinned -> Device)", "other"),
    ],
)
def test_kernel_kind(name: str, kind: str) -> None:
    assert kernel_kind(name) == kind
