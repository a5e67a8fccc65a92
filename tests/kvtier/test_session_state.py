"""A session's state changes only through its own methods (kvtier/cache/session.py:
`begin_turn`, `end_turn`, `abort_turn`, `hibernated`, `closed`), and those refuse the
transitions the cache never makes.

The first check reads the source with `ast`: no module of `kvtier` that speaks of
`SessionState` assigns an attribute named `state`, session.py aside. It is shown to fail on a
planted assignment.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

from kvtier import CacheConfig, TieredCache
from kvtier.errors import SessionError
from kvtier.integrations.hf import cache_kwarg
from kvtier.types import SessionState

REPO = Path(__file__).resolve().parents[2]
SESSION = REPO / "kvtier" / "cache" / "session.py"
CHUNK = 16


def state_assignments(source: str) -> list[int]:
    """The lines of `source` that set an attribute named `state` (an assignment, one target of
    a tuple, or `setattr(x, "state", ...)`), in a module that names `SessionState`."""
    if "SessionState" not in source:
        return []  # another object's `state` (a breaker's, a failover's)
    lines = []
    for node in ast.walk(ast.parse(source)):
        line: int = getattr(node, "lineno", 0)
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == "state"
        ):
            lines.append(line)
        for target in targets:
            if any(
                isinstance(n, ast.Attribute) and n.attr == "state" and isinstance(n.ctx, ast.Store)
                for n in ast.walk(target)
            ):
                lines.append(line)
    return sorted(lines)


def test_only_the_session_sets_its_state() -> None:
    found = {
        str(path.relative_to(REPO)): lines
        for path in sorted((REPO / "kvtier").rglob("*.py"))
        if path != SESSION and (lines := state_assignments(path.read_text()))
    }
    assert not found, f"set a session's state through its methods (session.py): {found}"
    assert state_assignments(SESSION.read_text())  # the methods themselves are seen


def test_the_check_finds_a_planted_assignment() -> None:
    planted = (
        "from kvtier.types import SessionState\n"
        "s.state = SessionState.IDLE\n"
        "s.in_pages, s.state = False, SessionState.HIBERNATED\n"
        "setattr(s, 'state', SessionState.CLOSED)\n"
        "s.state is SessionState.ACTIVE\n"
    )
    assert state_assignments(planted) == [2, 3, 4]
    assert state_assignments("self.state = HEALTHY\n") == []  # no SessionState: not a session


def _cfg(root: Path) -> CacheConfig:
    return CacheConfig(
        l3_root=root,
        l1_bytes=8 << 20,
        l2_bytes=4 << 20,
        chunk_tokens=CHUNK,
        cost_model=False,
        pin_memory=False,
    )


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_a_session_moves_through_its_states_and_refuses_the_others(tmp_path: Path, model) -> None:
    ids = torch.randint(1, 250, (1, 3 * CHUNK + 5), generator=torch.Generator().manual_seed(0))
    with TieredCache(_cfg(tmp_path), model=model) as cache:
        s = cache.session("a", tenant="t")
        assert s.state is SessionState.IDLE
        with pytest.raises(SessionError, match="no turn to end"):
            s.end_turn()  # nothing was restored
        pkv = s.restore(ids)
        assert s.state is SessionState.ACTIVE
        with pytest.raises(SessionError, match="cannot start a turn: active"):
            s.begin_turn()  # one turn at a time
        with pytest.raises(SessionError, match="request running"):
            s.closed()
        with torch.no_grad():
            model(ids[:, pkv.get_seq_length() :], **{cache_kwarg(model): pkv})
        s.commit(ids)
        assert s.state is SessionState.IDLE and s.resident and not s.in_pages

        s.hibernate()
        assert s.state is SessionState.HIBERNATED and not s.resident and not s.in_pages

        s.restore(ids)  # back into L1 from L2, then aborted: idle in L1
        s.abort()
        assert s.state is SessionState.IDLE and s.resident

        s.close()
        assert s.state is SessionState.CLOSED
        s.abort()  # nothing runs on it: nothing to abort
        assert s.state is SessionState.CLOSED
        with pytest.raises(SessionError, match="closed"):
            s.restore(ids)
        with pytest.raises(SessionError, match="cannot start a turn: closed"):
            s.begin_turn()
        with pytest.raises(SessionError, match="is closed"):
            s.abort_turn()
