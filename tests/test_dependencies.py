"""Every third-party module the code imports is declared in pyproject.toml, in the group whose
users need it: `kvtier`/`ops` in the core dependencies or an extra, the tests in `dev`, and
matplotlib only in the `plots` extra, which `server` (the demo) and `dev` pull in."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
LOCAL = ("kvtier", "ops", "tests", "bench", "dashboards")  # modules tests import by path
# Imported only on a CUDA device, where torch's CUDA wheels bring it as their own dependency
# (kvtier.paged's Triton decode kernel); a CPU install has no use for it.
WITH_CUDA_TORCH = {"triton"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def declared(*extras: str) -> set[str]:
    """Distribution names of the core dependencies plus `extras`, following kvtier[x] links."""
    names = {_name(r) for r in PROJECT["dependencies"]}
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in EXTRAS[extra]:
            m = re.fullmatch(r"kvtier\[([\w,-]+)\]", req.split(";")[0].strip())
            if m:
                todo.extend(m.group(1).split(","))
            else:
                names.add(_name(req))
    return names


def imports(*dirs: str) -> dict[str, set[str]]:
    """Top-level third-party module -> the files importing it (repo-local modules left out)."""
    local = {p.stem for d in LOCAL for p in (REPO / d).rglob("*.py")} | {"kvtier", "ops"}
    out: dict[str, set[str]] = {}
    for d in dirs:
        for path in (REPO / d).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in local:
                        out.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return out


def distribution(module: str) -> str:
    if module == "tomli":  # the Python < 3.11 backport of tomllib, declared with a marker
        return "tomli"
    dists = packages_distributions().get(module)
    if not dists:
        pytest.fail(f"{module} is imported but not installed: declare it in pyproject.toml")
    return dists[0].lower().replace("_", "-")


@pytest.mark.parametrize(
    ("dirs", "extras"),
    [(("kvtier", "ops"), tuple(EXTRAS)), (("tests",), ("dev",)), (("bench",), ("dev",))],
)
def test_every_import_is_declared(dirs: tuple[str, ...], extras: tuple[str, ...]) -> None:
    have = declared(*extras)
    missing = {
        m: sorted(files)
        for m, files in imports(*dirs).items()
        if m not in WITH_CUDA_TORCH and distribution(m) not in have
    }
    assert not missing, f"imported but not declared for {'/'.join(extras)}: {missing}"


def test_matplotlib_lives_in_the_plots_extra() -> None:
    assert [_name(r) for r in EXTRAS["plots"]] == ["matplotlib"]
    assert "matplotlib" not in declared()  # not a core dependency
    assert "matplotlib" in declared("server") and "matplotlib" in declared("dev")
    for extra, reqs in EXTRAS.items():
        if extra != "plots":
            assert "matplotlib" not in {_name(r) for r in reqs}, extra
