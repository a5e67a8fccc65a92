"""Exactness of the tiered cache (CPU, float32): kvtier must give the tokens and logits that a
full recompute with plain DynamicCache gives, whichever tier the prefix comes back from."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import MODELS
from transformers import DynamicCache

from kvtier import CacheConfig, TieredCache
from kvtier.integrations.hf import cache_kwarg

CHUNK = 16
TURNS = [[5, 9, 13] * 14, [7, 3] * 9, [11] * 23, [2, 4, 6, 8] * 6]  # 42, 18, 23, 24 new tokens


def config(root: Path, **kw) -> CacheConfig:
    base = dict(
        l3_root=root,
        l1_bytes=64 << 20,
        l2_bytes=16 << 20,
        chunk_tokens=CHUNK,
        cost_model=False,  # always load: these tests check the loaded bytes, not the choice
        pin_memory=False,
    )
    base.update(kw)
    return CacheConfig(**base)


def greedy(model, ids: torch.Tensor, pkv, steps: int = 6):
    out = model.generate(
        ids,
        **{cache_kwarg(model): pkv},
        max_new_tokens=steps,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences, torch.stack(out.scores)


def reference(model, ids: torch.Tensor):
    return greedy(model, ids, DynamicCache())


def run_turns(model, cache_factory, between, session_id="s1", tenant="t"):
    """Multi-turn greedy conversation; `between(cache, session)` forces an eviction."""
    cache = cache_factory()
    ids = torch.tensor([[1]], dtype=torch.long)
    sources = []
    for turn, new in enumerate(TURNS):
        ids = torch.cat([ids, torch.tensor([new])], dim=1)
        s = cache.session(session_id, tenant=tenant)
        pkv = s.restore(ids)
        restored = pkv.get_seq_length()
        seq, scores = greedy(model, ids, pkv)
        s.commit(seq)
        sources.append((s.restore_source, restored))
        ref_seq, ref_scores = reference(model, ids)
        assert torch.equal(seq, ref_seq), f"turn {turn}: tokens differ from full recompute"
        torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)
        ids = seq
        cache = between(cache, s) or cache
    cache.close()
    return sources


@pytest.mark.parametrize("name", sorted(MODELS))
def test_l1_resident_turns_match_recompute(tmp_path: Path, name: str) -> None:
    model = MODELS[name]()
    sources = run_turns(model, lambda: TieredCache(config(tmp_path), model), lambda c, s: None)
    assert [src for src, _ in sources[1:]] == ["l1"] * (len(TURNS) - 1)
    assert all(n > 0 for _, n in sources[1:])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_evicted_to_l2_matches_recompute(tmp_path: Path, name: str) -> None:
    model = MODELS[name]()
    sources = run_turns(
        model, lambda: TieredCache(config(tmp_path), model), lambda c, s: s.hibernate()
    )
    assert [src for src, _ in sources[1:]] == ["l2"] * (len(TURNS) - 1)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_evicted_to_l3_matches_recompute(tmp_path: Path, name: str) -> None:
    model = MODELS[name]()

    def to_l3(cache, s):
        s.hibernate()
        cache.evict_l2()

    sources = run_turns(model, lambda: TieredCache(config(tmp_path), model), to_l3)
    assert [src for src, _ in sources[1:]] == ["l3"] * (len(TURNS) - 1)


def test_l3_after_new_cache_object_matches(tmp_path: Path) -> None:
    model = MODELS["llama"]()

    def reopen(cache, s):
        cache.close()
        return TieredCache(config(tmp_path), model)

    sources = run_turns(model, lambda: TieredCache(config(tmp_path), model), reopen)
    assert [src for src, _ in sources[1:]] == ["l3"] * (len(TURNS) - 1)


NEW_PROCESS = textwrap.dedent(
    """
    import sys, torch, json
    sys.path.insert(0, sys.argv[2])
    from conftest import MODELS
    from kvtier import CacheConfig, TieredCache
    from test_cache_exact import config, greedy
    model = MODELS["llama"]()
    cache = TieredCache(config(sys.argv[1]), model)
    ids = torch.tensor([json.loads(sys.argv[3])])
    s = cache.session("proc", tenant="t")
    pkv = s.restore(ids)
    restored = pkv.get_seq_length()
    seq, scores = greedy(model, ids, pkv)
    s.commit(seq)
    s.hibernate()
    cache.close()
    torch.save({"seq": seq, "scores": scores, "restored": restored, "src": s.restore_source},
               sys.argv[4])
    """
)


def test_new_process_resumes_hibernated_session(tmp_path: Path) -> None:
    """Turn 1 in one process, hibernate, exit; turn 2 in a fresh process restores from L3."""
    here = str(Path(__file__).parent)
    script = tmp_path / "turn.py"
    script.write_text(NEW_PROCESS)
    root = tmp_path / "l3"
    model = MODELS["llama"]()
    ids = [1, *TURNS[0]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])}
    out1 = tmp_path / "t1.pt"
    subprocess.run(
        [sys.executable, str(script), str(root), here, str(ids), str(out1)], check=True, env=env
    )
    first = torch.load(out1)
    assert first["src"] == "recompute"
    ids2 = first["seq"][0].tolist() + TURNS[1]
    out2 = tmp_path / "t2.pt"
    subprocess.run(
        [sys.executable, str(script), str(root), here, str(ids2), str(out2)], check=True, env=env
    )
    second = torch.load(out2)
    assert second["src"] == "l3"
    assert second["restored"] == len(first["seq"][0]) - 1  # everything the KV covered
    ref_seq, ref_scores = reference(model, torch.tensor([ids2]))
    assert torch.equal(second["seq"], ref_seq)
    torch.testing.assert_close(second["scores"], ref_scores, atol=1e-5, rtol=0)


def test_corrupted_chunk_falls_back_to_recompute(tmp_path: Path) -> None:
    model = MODELS["llama"]()
    cache = TieredCache(config(tmp_path), model)
    ids = torch.tensor([[1, *TURNS[0]]])
    s = cache.session("c", tenant="t")
    seq, _ = greedy(model, ids, s.restore(ids))
    s.commit(seq)
    s.hibernate()
    cache.close()
    files = sorted((tmp_path / "hot").rglob("*.kvbin"))
    assert files
    for f in files:  # flip one payload byte in every chunk file
        data = bytearray(f.read_bytes())
        data[4096 + 7] ^= 0x01
        f.write_bytes(bytes(data))
    cache = TieredCache(config(tmp_path), model)
    s = cache.session("c", tenant="t")
    ids2 = torch.cat([seq, torch.tensor([TURNS[1]])], dim=1)
    pkv = s.restore(ids2)
    assert pkv.get_seq_length() == 0 and s.restore_source == "recompute"
    got, scores = greedy(model, ids2, pkv)
    ref, ref_scores = reference(model, ids2)
    assert torch.equal(got, ref)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)
    snap = cache.stats()
    assert snap.checksum_failures >= 1
    assert any((tmp_path / "quarantine").iterdir())
    cache.close()


def test_prefix_shared_by_100_sessions_is_stored_once(tmp_path: Path) -> None:
    model = MODELS["llama"]()
    system = [(i * 7) % 251 + 1 for i in range(2048)]
    cache = TieredCache(config(tmp_path, chunk_tokens=256, l1_bytes=256 << 20), model)
    for n in range(100):
        ids = torch.tensor([[*system, 300 % 256, n % 256]])
        s = cache.session(f"user-{n}", tenant="acme")
        pkv = s.restore(ids)
        if n:
            assert pkv.get_seq_length() >= 2048  # the shared prompt came from cache
        with torch.no_grad():
            model(ids[:, pkv.get_seq_length() :], **{cache_kwarg(model): pkv})
        s.commit(ids)
        s.hibernate()
    cache.flush()
    snap = cache.stats()
    prefix_chunks = 2048 // 256
    # 8 shared chunks + each session's 2-token tail, never 100 copies of the prompt.
    assert snap.tier("l3").chunks == prefix_chunks + 100
    cache.close()


def test_tenants_never_share(tmp_path: Path) -> None:
    model = MODELS["llama"]()
    prompt = torch.tensor([[(i * 5) % 250 + 1 for i in range(64)]])
    cache = TieredCache(config(tmp_path), model)
    a = cache.session("same-id", tenant="a")
    pkv = a.restore(prompt)
    with torch.no_grad():
        model(prompt[:, pkv.get_seq_length() :], **{cache_kwarg(model): pkv})
    a.commit(prompt)
    a.hibernate()
    b = cache.session("same-id", tenant="b")
    pkv = b.restore(prompt)
    assert pkv.get_seq_length() == 0 and b.restore_source == "recompute"
    assert a is not b
    cache.close()
