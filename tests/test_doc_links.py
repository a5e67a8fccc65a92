"""Every file a doc names is in the repo: the project stands on its own.

Scans the Markdown docs, the READMEs, the code's docstrings and comments, and the lint
configuration for names of repo files
(`docs/api.md`, `kvtier/cache/core.py`, `README.md`, ...) and checks each one exists. A name
with a directory part must resolve from the repo root or from the doc's own folder; a bare
Markdown name must be some file of the repo, and a path may also be the tail of a repo path
(`integrations/hf.py` inside a paragraph about `kvtier/`).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXTS = "md|py|sh|yml|yaml|toml|json|cfg|ini|txt"
# (a name followed by one more extension, `haproxy.cfg.j2`, is that longer name, not a .cfg)
NAME = re.compile(rf"(?<![\w/.<>$~-])((?:[\w.-]+/)*[\w.-]+\.(?:{EXTS}))(?![\w/]|\.\w)")
# Names that are not repo files: written by the program at run time, or on the user's host.
NOT_REPO = re.compile(
    r"^(?:proc/|sys/|etc/|dev/|tmp/|var/|usr/|run/|home/|[A-Z_]+/)|"
    r"(?:^|/)(?:results|summary|profile|config|kvtier|serve|loadgen|out|report)\.(?:json|toml|txt)$"
)


def _docs() -> list[Path]:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    picked = [
        ROOT / f
        for f in tracked
        if f.endswith((".md", ".py")) or f in (".importlinter", "pyproject.toml")
    ]
    # the tests that write files on purpose (a missing name to catch, a module to plant)
    planted = {Path(__file__).resolve(), ROOT / "tests" / "test_layering.py"}
    return [p for p in picked if p.exists() and p.resolve() not in planted]


def _repo_files() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def _missing(doc: Path, files: set[str]) -> list[str]:
    names = {Path(f).name for f in files}
    dirs = {str(Path(f).parent) for f in files}
    bad = []
    for name in sorted(set(NAME.findall(doc.read_text(encoding="utf-8")))):
        if NOT_REPO.search(name) or name.startswith((".", "http")):
            continue
        if "/" not in name:
            if name.endswith(".md") and name not in names:
                bad.append(name)
            continue
        rel = (doc.parent / name).resolve()
        candidates = {name, str(rel.relative_to(ROOT)) if rel.is_relative_to(ROOT) else ""}
        if candidates & files or any(c in dirs for c in candidates):
            continue
        if not any(f.endswith("/" + name) for f in files):  # a path inside a named folder
            bad.append(name)
    return bad


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_doc_names_exists(doc: Path) -> None:
    assert _missing(doc, _repo_files()) == [], f"{doc.relative_to(ROOT)} names files the repo lacks"


def test_the_check_catches_a_missing_file(tmp_path: Path) -> None:
    doc = ROOT / "docs" / "_probe_for_test.md"
    doc.write_text("The blueprint is BLUEPRINT.md; see docs/nowhere.md and docs/api.md.\n")
    try:
        assert _missing(doc, _repo_files()) == ["BLUEPRINT.md", "docs/nowhere.md"]
    finally:
        doc.unlink()
