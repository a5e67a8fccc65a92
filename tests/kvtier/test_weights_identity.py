"""KV computed by other weights is never served (issue: two models of one config shared chunks).

The model fingerprint covers a digest of every weight, so a chunk written under one set of
weights is a miss under any other, in one process or across processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import MODELS
from test_cache_exact import config, greedy, reference

from kvtier import TieredCache
from kvtier.weights import weights_digest

PROMPT = [1, *([5, 9, 13] * 14)]  # 43 tokens: two full 16-token chunks and a tail


def _first_turn(model, root: Path, session_id: str = "s") -> list[int]:
    with TieredCache(config(root), model) as cache:
        s = cache.session(session_id, tenant="t")
        ids = torch.tensor([PROMPT])
        seq, _ = greedy(model, ids, s.restore(ids))
        s.commit(seq)
        s.hibernate()
    return seq[0].tolist()


def _second_turn(model, root: Path, ids: list[int], session_id: str = "s"):
    """Restore (whatever the cache offers) and decode; returns source, tokens, scores."""
    with TieredCache(config(root), model) as cache:
        s = cache.session(session_id, tenant="t")
        t = torch.tensor([ids])
        pkv = s.restore(t)
        restored = pkv.get_seq_length()
        seq, scores = greedy(model, t, pkv)
        s.commit(seq)
        return s.restore_source, restored, seq, scores


@pytest.mark.parametrize("name", sorted(MODELS))
def test_digest_depends_on_every_value_not_only_the_config(name: str) -> None:
    a, b = MODELS[name](seed=0), MODELS[name](seed=1)
    assert weights_digest(a) == weights_digest(MODELS[name](seed=0))
    assert weights_digest(a) != weights_digest(b)
    # one element of one matrix, changed in place
    w = next(p for n, p in a.named_parameters() if n.endswith("mlp.down_proj.weight"))
    before = weights_digest(a)
    with torch.no_grad():
        w[3, 7] += 1e-3
    assert weights_digest(a) != before
    # two elements swapped: the plain sum stays, the position-weighted sum does not
    with torch.no_grad():
        w[3, 7] -= 1e-3
        w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()
    assert weights_digest(a) != before


def test_two_same_config_models_share_nothing(tmp_path: Path) -> None:
    a, b = MODELS["llama"](seed=0), MODELS["llama"](seed=1)
    assert a.config.to_dict() == b.config.to_dict()
    seq = _first_turn(a, tmp_path)
    ids = seq + [7, 3] * 9
    src, restored, out, scores = _second_turn(b, tmp_path, ids)
    assert (src, restored) == ("recompute", 0), "KV of model A was served to model B"
    ref_seq, ref_scores = reference(b, torch.tensor([ids]))
    assert torch.equal(out, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)
    # and model A still finds its own chunks
    src_a, restored_a, _, _ = _second_turn(a, tmp_path, ids)
    assert src_a == "l3" and restored_a == len(seq) - 1


def test_same_session_id_under_other_weights_restores_nothing(tmp_path: Path) -> None:
    a = MODELS["qwen2"](seed=0)
    b = MODELS["qwen2"](seed=0)
    with torch.no_grad():
        b.model.layers[1].self_attn.v_proj.weight.mul_(1.5)
    seq = _first_turn(a, tmp_path, session_id="agent-1")
    src, restored, _, _ = _second_turn(b, tmp_path, seq + [11] * 5, session_id="agent-1")
    assert (src, restored) == ("recompute", 0)


FIRST_PROCESS = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    from conftest import MODELS
    from test_weights_identity import _first_turn
    from pathlib import Path
    print(_first_turn(MODELS["llama"](seed=0), Path(sys.argv[1])))
    """
)


def test_weight_changed_in_place_between_processes(tmp_path: Path) -> None:
    """Process 1 writes KV; process 2 loads the same weights with one value changed."""
    here = str(Path(__file__).parent)
    script = tmp_path / "first.py"
    script.write_text(FIRST_PROCESS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])}
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "l3"), here],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    seq = [int(x) for x in out.stdout.strip().strip("[]").split(",")]
    model = MODELS["llama"](seed=0)
    # unchanged weights in this process: the chunks are found (the test can fail)
    src, restored, _, _ = _second_turn(model, tmp_path / "l3", [*seq, 2, 4])
    assert src == "l3" and restored == len(seq) - 1
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-4
    src, restored, out_seq, scores = _second_turn(model, tmp_path / "l3", [*seq, 2, 4])
    assert (src, restored) == ("recompute", 0)
    ref_seq, ref_scores = reference(model, torch.tensor([[*seq, 2, 4]]))
    assert torch.equal(out_seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)


def test_device_sums_see_one_changed_and_two_swapped_elements() -> None:
    """The GPU path's reduction, run here on host tensors (the same torch ops)."""
    from kvtier.weights import _BLOCK, _PERIOD, _tensor_sums

    weight = torch.arange(_BLOCK + _PERIOD, dtype=torch.int64).remainder_(_PERIOD).add_(1)
    t = torch.randn(64, 48).to(torch.bfloat16)
    base = _tensor_sums(t, weight)
    assert torch.equal(base, _tensor_sums(t.clone(), weight))
    changed = t.clone()
    changed[5, 5] = changed[5, 5] * 1.01 + 0.01
    assert not torch.equal(base, _tensor_sums(changed, weight))
    swapped = t.clone()
    swapped[0, 0], swapped[0, 1] = t[0, 1], t[0, 0]
    assert not torch.equal(base, _tensor_sums(swapped, weight))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_digest_on_gpu_is_stable_and_sees_a_change() -> None:
    model = MODELS["llama"]().to("cuda", torch.bfloat16)
    first = weights_digest(model)
    assert first == weights_digest(model)
    with torch.no_grad():
        model.lm_head.weight[1, 2] += 1
    assert weights_digest(model) != first
