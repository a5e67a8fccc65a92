"""The layering rule (docs/architecture.md, "Layering") is enforced by import-linter (`make layering`).

These tests show that the checker really fails on a violation: they copy the packages into a
temporary tree, plant one bad module, and run lint-imports there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _tree_with(tmp_path: Path, rel: str, source: str) -> Path:
    for pkg in ("kvtier", "ops"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    bad = tmp_path / rel
    bad.parent.mkdir(parents=True, exist_ok=True)
    if source.startswith("+"):  # one more import in an existing module
        source = bad.read_text() + source[1:]
    bad.write_text(source)
    return tmp_path


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(root), "PATH": str(LINT_IMPORTS.parent)},
    )


def test_clean_tree_passes() -> None:
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("rel", "source", "contract"),
    [
        ("kvtier/bad_upward.py", "import ops.cli\n", "kvtier never imports ops"),
        ("kvtier/bad_upward2.py", "from ops import cli\n", "kvtier never imports ops"),
        ("ops/parsers/bad_torch.py", "import torch\n", "stay pure"),
        ("ops/parsers/bad_io.py", "import os\n", "stay pure"),
        ("kvtier/cache/bad_up.py", "import kvtier.server.http.app\n", "never imports the server"),
        ("kvtier/cache/guard.py", "+import kvtier.cache.core\n", "call down only"),
        ("kvtier/cache/restoreplan.py", "+import torch\n", "import no torch"),
        ("kvtier/cache/catalog.py", "+import kvtier.tiers.l2\n", "import no tier"),
        (
            "kvtier/server/batch/stepping.py",
            "+import kvtier.server.batch.batching\n",
            "scheduler's parts",
        ),
        ("kvtier/server/batch/scheduler.py", "+import torch\n", "scheduler's policy"),
        (
            "kvtier/server/devices/model.py",
            "+import kvtier.server.pages.manager\n",
            "folders call down",
        ),
        (
            "kvtier/server/decoding/tools.py",
            "+import kvtier.server.batch.jobs\n",
            "folders call down",
        ),
        ("kvtier/server/batch/jobs.py", "+import kvtier.server.http.common\n", "folders call down"),
        ("kvtier/server/batch/batching.py", "+import kvtier.server.pages.parking\n", "its face"),
    ],
)
def test_violation_fails(tmp_path: Path, rel: str, source: str, contract: str) -> None:
    result = _lint(_tree_with(tmp_path, rel, source))
    assert result.returncode != 0, "lint-imports accepted a layering violation"
    assert "BROKEN" in result.stdout and contract in result.stdout, result.stdout


def test_pure_modules_never_call_open() -> None:
    """import-linter sees imports only; a pure module could still call the open() builtin."""
    import ast

    pure_roots = [
        REPO / "ops" / "parsers",
        REPO / "kvtier" / "policy.py",
        REPO / "kvtier" / "snapshot.py",
        REPO / "kvtier" / "kvbin.py",
    ]
    files: list[Path] = []
    for root in pure_roots:
        files += sorted(root.rglob("*.py")) if root.is_dir() else [root] if root.exists() else []
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"open", "exec", "eval", "__import__"}
            ):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, f"pure modules doing I/O: {offenders}"
