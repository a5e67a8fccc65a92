"""`make test` checks the Triton kernels without a GPU: its `kernels` step runs the cases of
tests/kvtier/test_paged_triton.py marked `interpret` in Triton's CPU interpreter (the `unit`
step skips the whole file without CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNELS = "tests/kvtier/test_paged_triton.py"
FUSED = "tests/kvtier/test_fused.py"


def test_make_test_runs_the_kernels_in_the_interpreter() -> None:
    make = (REPO / "Makefile").read_text()
    test = next(line for line in make.splitlines() if line.startswith("test:"))
    assert "kernels" in test.split()[1:]
    recipe = make.split("\nkernels:\n", 1)[1].split("\n\n", 1)[0]
    for part in ("TRITON_INTERPRET=1", "CUDA_VISIBLE_DEVICES=", "-m interpret", KERNELS, FUSED):
        assert part in recipe, part


def test_the_interpret_subset_covers_every_kernel_test_in_fp16_or_fp32() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
         "-m", "interpret", KERNELS],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    ids = [line for line in out.stdout.splitlines() if line.startswith(KERNELS + "::")]
    tests = {i.split("::")[1].split("[")[0] for i in ids}
    assert tests == {
        "test_triton_decode_matches_reference",
        "test_triton_backend_in_the_model",
        "test_split_backend_mixes_prefill_and_decode_exactly",
        "test_prefill_tiles_match_one_row_per_program",
    }
    assert 15 <= len(ids) <= 40, ids  # about a minute on 2 cores, not the 4 of the whole file
    assert not [i for i in ids if "bfloat16" in i]  # the interpreter has no bf16 tl.dot
    pages = {i.rsplit("-", 2)[1] for i in ids if "decode_matches" in i}
    assert pages == {"1", "16", "256"}
