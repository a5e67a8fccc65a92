"""The Triton flash-decoding kernel against an fp32 SDPA reference.

On a CUDA device it runs compiled. Without one it runs in Triton's CPU interpreter when Triton is
installed and TRITON_INTERPRET=1 is set (`TRITON_INTERPRET=1 pytest tests/kvtier/
test_paged_triton.py`, about 4 minutes on 2 cores); the interpreter has no bf16 matrix product,
so bf16 runs on CUDA only. Skipped otherwise.

`make test` runs the cases marked `interpret` in the interpreter (`make kernels`, about a minute
on 2 cores), so the kernels' logic is checked on every change without a GPU: every page size and
split count on an MQA shape whose head size is no power of two, in fp16 and fp32; the GQA shape
of Qwen2-7B and an MHA shape once each; both models through the kernel; prompt tiles of the prefill kernel beside
decode rows with one and several splits."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1"),
]


def _case(batch_lens, heads, kv_heads, dim, page, dtype):  # type: ignore[no-untyped-def]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    per_seq = [-(-n // page) for n in batch_lens]
    pages = sum(per_seq) + 3
    k_cache = torch.randn(pages, page, kv_heads, dim, device=DEVICE, generator=g).to(dtype)
    v_cache = torch.randn(pages, page, kv_heads, dim, device=DEVICE, generator=g).to(dtype)
    perm = torch.randperm(pages, device=DEVICE, generator=g)
    table = torch.zeros(len(batch_lens), max(per_seq), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    q = torch.randn(len(batch_lens), heads, dim, device=DEVICE, generator=g).to(dtype)
    lens = torch.tensor(batch_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, table, lens


def _reference(q, k_cache, v_cache, table, batch_lens, scale):  # type: ignore[no-untyped-def]
    rep = q.shape[1] // k_cache.shape[2]
    outs = []
    for i, n in enumerate(batch_lens):
        pages = table[i, : -(-n // k_cache.shape[1])].long()
        k = k_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(rep, 1).transpose(0, 1)
        v = v_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(rep, 1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(q[i, :, None].float(), k, v, scale=scale)[:, 0])
    return torch.stack(outs)


INTERPRET_MARK = pytest.mark.interpret  # the subset `make kernels` runs (module docstring)
SHAPES = [(28, 4, 128), (4, 4, 64), (8, 1, 80)]  # (heads, KV heads, head size)


def _decode_cases() -> list:  # type: ignore[type-arg]
    """Every dtype x page size x shape x split count; the subset is marked `interpret`."""
    cases = []
    for splits in (None, 1, 5):
        for heads, kv_heads, dim in SHAPES:
            for page in (1, 16, 256):
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    subset = dtype != torch.bfloat16 and (
                        (heads, kv_heads, dim) == (8, 1, 80)
                        or (heads, page, splits, dtype) == (28, 16, 5, torch.float32)
                        or (heads, page, splits, dtype) == (4, 16, 1, torch.float32)
                    )
                    name = f"{splits}-{heads}-{kv_heads}-{dim}-{page}-{str(dtype)[6:]}"
                    values = (dtype, page, heads, kv_heads, dim, splits)
                    cases.append(_case_param(values, name, subset))
    return cases


def _case_param(values: tuple, name: str, subset: bool) -> object:  # type: ignore[type-arg]
    return pytest.param(*values, marks=[INTERPRET_MARK] if subset else [], id=name)


@pytest.mark.parametrize(("dtype", "page", "heads", "kv_heads", "dim", "splits"), _decode_cases())
def test_triton_decode_matches_reference(dtype, page, heads, kv_heads, dim, splits) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    from kvtier.paged.triton_decode import paged_decode

    if not CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton's CPU interpreter has no bf16 tl.dot")
    if not CUDA and splits is None:
        splits = 3  # the automatic choice reads the GPU's multiprocessor count

    batch_lens = [1, 15, 16, 17, 300, 1000, 257]
    q, k_cache, v_cache, table, lens = _case(batch_lens, heads, kv_heads, dim, page, dtype)
    scale = dim**-0.5
    got = paged_decode(q, k_cache, v_cache, table, lens, scale, num_splits=splits)
    want = _reference(q, k_cache, v_cache, table, batch_lens, scale)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", [pytest.param("llama", marks=INTERPRET_MARK), "qwen2"])
def test_triton_backend_in_the_model(name: str) -> None:
    """Prefill through the reference path, then batched decode steps through the kernel."""
    pytest.importorskip("triton")
    from conftest import MODELS
    from test_paged import _greedy_alone, _paged, _prompts

    from kvtier.paged import PagedSequence, SeqInput

    runner = _paged(name, device=DEVICE, backend="reference", page_size=4)
    reference = MODELS[name]().to(DEVICE)
    prompts = _prompts(9, [20, 33, 9])
    seqs = [PagedSequence() for _ in prompts]
    logits = runner.step([SeqInput(s, p) for s, p in zip(seqs, prompts, strict=True)])
    outs = [[int(row.argmax())] for row in logits]
    runner.backend = "triton"
    for _ in range(5):
        logits = runner.step([SeqInput(s, [o[-1]]) for s, o in zip(seqs, outs, strict=True)])
        for o, row in zip(outs, logits, strict=True):
            o.append(int(row.argmax()))
    for p, o in zip(prompts, outs, strict=True):
        assert o == _greedy_alone(reference, p, 6)


@pytest.mark.parametrize("name", ["llama", pytest.param("qwen2", marks=INTERPRET_MARK)])
def test_split_backend_mixes_prefill_and_decode_exactly(name: str) -> None:
    """Mixed steps: new sequences prefill beside decoding ones; decode rows go through the
    kernel, prefill rows through SDPA over their pages. Tokens equal each sequence alone."""
    pytest.importorskip("triton")
    from conftest import MODELS
    from test_paged import _greedy_alone, _paged, _prompts

    from kvtier.paged import PagedSequence, SeqInput

    runner = _paged(name, device=DEVICE, backend="split", page_size=4)
    reference = MODELS[name]().to(DEVICE)
    prompts = _prompts(11, [20, 33, 9, 14])
    seqs = [PagedSequence() for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    # sequence 0 and 1 start at once; 2 joins at step 2 and 3 at step 4, each prefilling in a
    # step where the others decode
    joins = {0: [0, 1], 2: [2], 4: [3]}
    active: list[int] = []
    for step in range(9):
        items = []
        for i in joins.get(step, []):
            active.append(i)
            items.append((i, prompts[i]))
        items += [(i, [outs[i][-1]]) for i in active if outs[i] and len(outs[i]) < 6]
        if not items:
            break
        logits = runner.step([SeqInput(seqs[i], toks) for i, toks in items])
        for (i, _), row in zip(items, logits, strict=True):
            outs[i].append(int(row.argmax()))
    for p, o in zip(prompts, outs, strict=True):
        assert o == _greedy_alone(reference, p, len(o))
        assert len(o) >= 5


def _rows_case(seqs, heads, kv_heads, dim, page, dtype):  # type: ignore[no-untyped-def]
    """A step's rows: per (old context, new tokens) sequence, one row per new token."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    per = [-(-(old + n) // page) for old, n in seqs]
    pages = sum(per) + 2
    k_cache = torch.randn(pages, page, kv_heads, dim, device=DEVICE, generator=g).to(dtype)
    v_cache = torch.randn(pages, page, kv_heads, dim, device=DEVICE, generator=g).to(dtype)
    perm = torch.randperm(pages, device=DEVICE, generator=g).to(torch.int32)
    table = torch.zeros(len(seqs), max(per), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, n in enumerate(per):
        table[i, :n] = perm[used : used + n]
        used += n
    row_seq = [i for i, (_, n) in enumerate(seqs) for _ in range(n)]
    row_len = [p + 1 for old, n in seqs for p in range(old, old + n)]
    q = torch.randn(len(row_seq), heads, dim, device=DEVICE, generator=g).to(dtype)
    as_int = {"dtype": torch.int32, "device": DEVICE}
    return q, k_cache, v_cache, table, torch.tensor(row_seq, **as_int), row_len


def _row_cases() -> list:  # type: ignore[type-arg]
    cases = []
    for splits in (1, 4):
        for heads, kv_heads, dim in SHAPES:
            for dtype in (torch.bfloat16, torch.float32):
                subset = dtype == torch.float32 and (heads, kv_heads, dim) == (8, 1, 80)
                name = f"{splits}-{heads}-{kv_heads}-{dim}-{str(dtype)[6:]}"
                cases.append(_case_param((dtype, heads, kv_heads, dim, splits), name, subset))
    return cases


@pytest.mark.parametrize("tile", [16, 64])
@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "dim", "splits"), _row_cases())
def test_prefill_tiles_match_one_row_per_program(  # type: ignore[no-untyped-def]
    dtype, heads, kv_heads, dim, splits, tile
) -> None:
    """Prompt chunks in tiles of the prefill kernel (one program per tile and head), decode
    rows through the decode kernel beside them, give each row what the one-row path and an
    fp32 SDPA reference give: chunks longer and shorter than a tile, a chunk from position 0,
    a chunk of two tokens, contexts below, at and across a key block, and unused tile entries
    past the step's tiles (as a CUDA graph's grid has them), each tile whole or its keys split
    over several programs. For the default tile and a small one (bench/paged_attention.py
    --tune-tiles)."""
    pytest.importorskip("triton")
    from kvtier.paged.rowblocks import count_tiles, row_blocks
    from kvtier.paged.triton_decode import paged_decode
    from kvtier.paged.triton_prefill import paged_prefill

    if not CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton's CPU interpreter has no bf16 tl.dot")
    seqs = [(300, 1), (0, 21), (40, 1), (250, 70), (7, 2), (1000, 1), (64, 9), (120, 8)]
    q, k_cache, v_cache, table, row_seq, row_len = _rows_case(seqs, heads, kv_heads, dim, 16, dtype)
    lens = torch.tensor(row_len, dtype=torch.int32, device=DEVICE)
    query_lens = [n for _, n in seqs]
    first, rows = row_blocks(query_lens, tile)
    tiles = count_tiles(query_lens, tile)
    assert rows[:tiles] and min(rows[:tiles]) > 1 and set(rows[tiles:]) == {1}
    pad = len(row_len) - len(first)
    blocks = (
        torch.tensor(first + [0] * pad, dtype=torch.int32, device=DEVICE),
        torch.tensor(rows + [0] * pad, dtype=torch.int32, device=DEVICE),
    )
    scale = dim**-0.5
    args = (q, k_cache, v_cache, table, lens, scale)
    kw = {"max_len": max(row_len), "num_splits": splits, "row_seq": row_seq}
    got = paged_decode(*args, **kw, blocks=blocks)
    # the decode kernel's splits, and the prefill's: one program per tile, or each tile's keys
    # over several programs (64 work slots for 6 or 10 tiles) merged by the second pass
    slots = 1 if splits == 1 else 64
    count = torch.tensor([tiles], dtype=torch.int32, device=DEVICE)
    paged_prefill(
        q, k_cache, v_cache, table, lens, row_seq, blocks, tiles + 3, scale, got,
        count=count, slots=slots, block_m=tile,
    )  # fmt: skip
    one = paged_decode(*args, **kw)
    want = _reference(q, k_cache, v_cache, table[row_seq.long()], row_len, scale)
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(got, one, rtol=tol, atol=tol)
