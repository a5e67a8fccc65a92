"""Paged attention and BatchRunner on tiny transformers models (CPU, float32, random weights).

The batched paged run must give exactly the tokens that each session gives alone through a
plain DynamicCache loop, with sessions joining and leaving, prompts prefilled in chunks under a
token budget next to decode tokens, and prefixes shared copy-on-write.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from conftest import MODELS
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import eager_attention_forward

from kvtier.errors import KvtierError
from kvtier.geometry import KVGeometry
from kvtier.paged import BatchRunner, PagedSequence, PagePool, PoolExhausted, SeqInput
from kvtier.paged.attention import paged_attention_forward
from kvtier.paged.context import paged_context


def _paged(
    name: str, pages: int = 256, page_size: int = 16, device: str = "cpu", backend: str = "auto"
) -> BatchRunner:
    model = MODELS[name]().to(device)
    geo = KVGeometry.from_config(model.config)
    budget = pages * page_size * geo.bytes_per_token
    pool = PagePool(geo, budget, page_size=page_size, device=device)
    return BatchRunner(model, pool, max_batch=16, max_tokens=64, max_seq_len=512, backend=backend)


def _greedy_alone(model: Any, prompt: list[int], new: int) -> list[int]:
    """Each session alone, through transformers' own DynamicCache (SDPA attention)."""
    cache = DynamicCache(config=model.config)
    # transformers renamed `past_key_values` to `cache`; older releases know only the first.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(new):
            logits = model(input_ids=ids, use_cache=True, **{name: cache}).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]], device=device)
    return out


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_paged_attention_equals_sdpa_and_eager(name: str) -> None:
    """One mixed step: a prefill from scratch, a prefill chunk after a prefix, a decode token."""
    runner = _paged(name, page_size=8)
    attn = runner.model.model.layers[1].self_attn
    heads, kv_heads, dim = 4, runner.pool.geometry.num_kv_heads, runner.pool.geometry.head_dim
    g = torch.Generator().manual_seed(3)
    seqs = [PagedSequence() for _ in range(3)]
    past = [0, 13, 30]  # tokens already in the pool
    new = [11, 6, 1]
    full_k = [
        torch.randn(1, kv_heads, p + n, dim, generator=g) for p, n in zip(past, new, strict=False)
    ]
    full_v = [
        torch.randn(1, kv_heads, p + n, dim, generator=g) for p, n in zip(past, new, strict=False)
    ]
    full_q = [
        torch.randn(1, heads, p + n, dim, generator=g) for p, n in zip(past, new, strict=False)
    ]

    def run(items: list[SeqInput], parts: list[slice]) -> torch.Tensor:
        ctx = runner.prepare(items)
        cat = lambda xs: torch.cat([x[:, :, s] for x, s in zip(xs, parts, strict=False)], dim=2)  # noqa: E731
        idx = [seqs.index(item.seq) for item in items]
        q, k, v = (cat([t[i] for i in idx]) for t in (full_q, full_k, full_v))
        with paged_context(ctx):
            out, _ = paged_attention_forward(attn, q, k, v, None, scaling=attn.scaling)
        runner.advance(items)
        return out

    warm = [i for i in range(3) if past[i]]
    run([SeqInput(seqs[i], [0] * past[i]) for i in warm], [slice(0, past[i]) for i in warm])
    out = run(
        [SeqInput(s, [0] * n) for s, n in zip(seqs, new, strict=False)],
        [slice(p, p + n) for p, n in zip(past, new, strict=False)],
    )
    assert out.shape == (1, sum(new), heads, dim)
    start = 0
    for i, (p, n) in enumerate(zip(past, new, strict=False)):
        q = full_q[i][:, :, p:]
        allowed = torch.arange(p + n)[None, :] <= torch.arange(p, p + n)[:, None]
        want, _ = sdpa_attention_forward(
            attn, q, full_k[i], full_v[i], allowed[None, None], scaling=attn.scaling
        )
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        eager, _ = eager_attention_forward(
            attn, q, full_k[i], full_v[i], additive[None, None], scaling=attn.scaling
        )
        got = out[:, start : start + n]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
        start += n


def test_attention_outside_a_paged_forward_says_what_to_do() -> None:
    runner = _paged("llama")
    with pytest.raises(KvtierError, match="BatchRunner"):
        runner.model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


@dataclass
class _Session:
    prompt: list[int]
    new: int
    join: int  # first step the session may take part in
    seq: PagedSequence = field(default_factory=PagedSequence)
    fed: int = 0  # prompt tokens prefilled so far
    out: list[int] = field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.fed == len(self.prompt)


def _serve(runner: BatchRunner, sessions: list[_Session], budget: int) -> list[int]:
    """A small scheduler: decode tokens first, then prompt chunks up to the token budget.

    Returns the number of sequences of every step."""
    sizes = []
    step = 0
    active: list[_Session] = []
    waiting = sorted(sessions, key=lambda s: s.join)
    while waiting or active:
        while waiting and waiting[0].join <= step:
            active.append(waiting.pop(0))
        batch: list[tuple[_Session, list[int]]] = []
        room = budget
        for s in active:
            if s.decoding:
                batch.append((s, [s.out[-1]]))
                room -= 1
        for s in active:
            if not s.decoding and room > 0:
                chunk = s.prompt[s.fed : s.fed + room]
                batch.append((s, chunk))
                room -= len(chunk)
        if batch:
            logits = runner.step([SeqInput(s.seq, tokens) for s, tokens in batch])
            sizes.append(len(batch))
            for (s, tokens), row in zip(batch, logits, strict=False):
                if not s.decoding:
                    s.fed += len(tokens)
                    if not s.decoding:
                        continue  # mid-prompt: these logits are not a prediction
                s.out.append(int(row.argmax()))
                if len(s.out) == s.new:
                    runner.release(s.seq)  # leaves mid-batch; its pages go back
                    active.remove(s)
        step += 1
    return sizes


@pytest.mark.parametrize("name", sorted(MODELS))
def test_batched_greedy_equals_each_session_alone(name: str) -> None:
    runner = _paged(name)
    reference = MODELS[name]()
    lengths = [5, 16, 17, 33, 50, 1, 40]
    news = [8, 12, 6, 10, 9, 7, 5]
    joins = [0, 0, 2, 3, 5, 9, 11]
    sessions = [
        _Session(p, n, j) for p, n, j in zip(_prompts(7, lengths), news, joins, strict=True)
    ]
    sizes = _serve(runner, sessions, budget=24)
    assert max(sizes) >= 4, "sessions really ran together"
    for s in sessions:
        assert s.out == _greedy_alone(reference, s.prompt, s.new), (len(s.prompt), s.join)
    assert runner.pool.num_free == runner.pool.num_pages, "every page went back"


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_batched_greedy_other_page_sizes(page_size: int) -> None:
    runner = _paged("llama", pages=4096 // page_size, page_size=page_size)
    reference = MODELS["llama"]()
    sessions = [
        _Session(p, 6, j) for p, j in zip(_prompts(11, [3, 70, 21]), [0, 1, 1], strict=False)
    ]
    _serve(runner, sessions, budget=32)
    for s in sessions:
        assert s.out == _greedy_alone(reference, s.prompt, s.new)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shared_prefix_copy_on_write(name: str) -> None:
    """Two sessions fork from one prefilled prompt that ends mid-page, then diverge."""
    runner = _paged(name)
    reference = MODELS[name]()
    pool = runner.pool
    (prompt,) = _prompts(5, [37])  # 2 full pages + 5 tokens
    base = PagedSequence()
    runner.step([SeqInput(base, prompt)])
    fork = pool.fork(base)
    assert pool.refcount(base.pages[2]) == 2
    free_before = pool.num_free
    # Both append in one step. The first copies the shared tail page; the second is then the
    # sole holder of the original and writes it in place: one page taken, no shared page written.
    logits = runner.step([SeqInput(base, [7]), SeqInput(fork, [9])])
    assert base.pages[:2] == fork.pages[:2] and base.pages[2] != fork.pages[2]
    assert pool.num_free == free_before - 1
    outs = {}
    for seq, first, row in ((base, 7, logits[0]), (fork, 9, logits[1])):
        tokens = [int(row.argmax())]
        for _ in range(5):
            tokens.append(int(runner.step([SeqInput(seq, [tokens[-1]])])[0].argmax()))
        outs[first] = tokens
    for first, tokens in outs.items():
        assert tokens == _greedy_alone(reference, [*prompt, first], 6)
    runner.release(base)
    runner.release(fork)
    assert pool.num_free == pool.num_pages


def test_full_pool_raises_and_changes_nothing() -> None:
    runner = _paged("llama", pages=6, page_size=16)  # 96 tokens
    pool = runner.pool
    a, b = PagedSequence(), PagedSequence()
    runner.step([SeqInput(a, list(range(3, 60)))])  # 4 pages
    free = pool.num_free
    with pytest.raises(PoolExhausted) as err:
        runner.step([SeqInput(a, [5]), SeqInput(b, list(range(3, 40)))])  # needs 3, 2 free
    assert err.value.needed == 3 and err.value.free == 2
    assert pool.num_free == free and a.length == 57 and b.length == 0 and b.pages == []
    runner.step([SeqInput(a, [5])])  # the decode alone fits
    runner.release(a)
    runner.step([SeqInput(b, list(range(3, 40)))])
    assert b.length == 37


def test_steps_reuse_the_same_storage() -> None:
    runner = _paged("qwen2")
    ptrs = {
        name: getattr(runner, name).data_ptr()
        for name in ("block_table", "input_ids", "position_ids", "slot_mapping", "context_lens")
    }
    kv = runner.pool.kv.data_ptr()
    seqs = [PagedSequence() for _ in range(3)]
    for n, seq in enumerate(seqs):
        runner.step([SeqInput(seq, list(range(3, 3 + 10 * (n + 1))))])
    for _ in range(3):
        runner.step([SeqInput(seq, [4]) for seq in seqs])
    assert runner.pool.kv.data_ptr() == kv
    assert {name: getattr(runner, name).data_ptr() for name in ptrs} == ptrs


def test_sliding_window_layers_match_transformers() -> None:
    """A Qwen2 whose first layer slides over 12 tokens: the reference path honours the window."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def build() -> Any:
        torch.manual_seed(0)
        cfg = Qwen2Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            use_sliding_window=True,
            sliding_window=12,
            max_window_layers=1,
            layer_types=["sliding_attention", "full_attention"],
        )
        return Qwen2ForCausalLM(cfg).eval()

    model = build()
    geo = KVGeometry.from_config(model.config)
    assert geo.sliding_layers == (0,)
    pool = PagePool(geo, 64 * 16 * geo.bytes_per_token, page_size=16)
    runner = BatchRunner(model, pool, max_batch=4, max_tokens=64, max_seq_len=512)
    sessions = [_Session(p, 8, j) for p, j in zip(_prompts(4, [30, 7, 19]), [0, 0, 1], strict=True)]
    _serve(runner, sessions, budget=16)
    reference = build()
    for s in sessions:
        assert s.out == _greedy_alone(reference, s.prompt, s.new)
