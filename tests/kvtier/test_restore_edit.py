"""A history edit restores the longest prefix any tier holds, not only what L1 shares with it.

The session's long history is stored in L2/L3; then a short conversation under the same id
leaves only its first tokens in L1 (or in its pages); then the client goes back to the long
history, edited late. The restore takes the chunk-aligned prefix the edit left from L2/L3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from test_cache_exact import CHUNK, config, greedy, reference

from kvtier import TieredCache
from kvtier.geometry import KVGeometry
from kvtier.paged import PagePool

LONG, SHORT, EDIT = 10 * CHUNK + 10, 20, 9 * CHUNK + 6  # EDIT: where the long history changes


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (1, n), generator=g)


def _histories() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    long = _ids(LONG, 0)
    short = torch.cat([long[:, :SHORT], _ids(12, 1)], 1)  # shares 20 tokens with it
    edited = torch.cat([long[:, :EDIT], _ids(30, 2)], 1)  # the long one, changed late
    return long, short, edited


def _pool(model) -> PagePool:
    g = KVGeometry.from_config(model.config)
    return PagePool(g, 256 * 4 * g.bytes_per_token, page_size=4, dtype=torch.float32)


def test_an_edit_restores_the_stored_prefix_beyond_what_l1_shares(tmp_path: Path, model) -> None:
    cache = TieredCache(config(tmp_path), model)
    long, short, edited = _histories()
    s = cache.session("a", tenant="t")
    for ids in (long, short):
        pkv = s.restore(ids)
        seq, _ = greedy(model, ids, pkv, steps=1)
        s.commit(seq[:, : ids.shape[1]])
    assert s.resident and len(s.tokens) == short.shape[1]  # L1 holds the short one
    pkv = s.restore(edited)
    cached = pkv.get_seq_length()
    assert cached == EDIT // CHUNK * CHUNK  # not the 20 tokens L1 shares with it
    assert s.restore_source in ("l2", "l3")
    seq, scores = greedy(model, edited, pkv)  # L1's first chunk + the loaded ones: exact
    ref_seq, ref_scores = reference(model, edited)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)
    s.commit(seq)
    cache.close()


def test_an_edit_through_a_page_pool_restores_from_l2(tmp_path: Path, model) -> None:
    cache = TieredCache(config(tmp_path), model)
    pool = _pool(model)
    long, short, edited = _histories()
    s = cache.session("a", tenant="t")
    for ids in (long, short):
        pkv = s.restore(ids, pool=pool)
        seq, _ = greedy(model, ids, pkv, steps=1)
        s.commit(seq[:, : ids.shape[1]])
    assert s.in_pages and len(s.tokens) == short.shape[1]
    # the server's batch asks first whether the turn may start from the session's pages
    assert cache.resume_pages(s, tuple(edited[0].tolist()), held=len(s.tokens)) == 0
    pkv = s.restore(edited, pool=pool)
    assert pkv.get_seq_length() == EDIT // CHUNK * CHUNK
    seq, scores = greedy(model, edited, pkv)
    ref_seq, ref_scores = reference(model, edited)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)
    s.commit(seq)
    cache.close()


def test_a_turn_that_extends_l1_still_starts_from_l1(tmp_path: Path, model) -> None:
    cache = TieredCache(config(tmp_path), model)
    long, _, _ = _histories()
    s = cache.session("a", tenant="t")
    pkv = s.restore(long)
    seq, _ = greedy(model, long, pkv, steps=1)
    s.commit(seq[:, :LONG])
    more = torch.cat([long, _ids(40, 3)], 1)
    assert s.restore(more).get_seq_length() == LONG and s.restore_source == "l1"
    cache.close()
