"""One source of truth: the role's defaults and argument specs agree with ops.tuning."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ops import tuning

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "ansible" / "roles" / "kvtier_host"


def test_defaults_file_is_the_rendering_of_ops_tuning() -> None:
    text = (REPO / tuning.ROLE_DEFAULTS_PATH).read_text()
    assert text == tuning.render_role_defaults(), (
        "defaults/main.yml differs from ops/tuning.py; regenerate it with "
        f"`python -m ops.tuning > {tuning.ROLE_DEFAULTS_PATH}`"
    )
    assert yaml.safe_load(text) == tuning.role_defaults()


def test_argument_specs_cover_every_variable_with_the_same_default() -> None:
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    defaults = tuning.role_defaults()
    assert set(options) == set(defaults) | {"kvtier_host_l2_bytes"}
    assert options["kvtier_host_l2_bytes"]["required"] is True
    for name, value in defaults.items():
        assert options[name]["default"] == value, name
        assert options[name]["description"], name
    assert options["kvtier_host_fstrim"]["choices"] == list(tuning.FSTRIM_POLICIES)


def test_every_variable_the_role_uses_is_specified() -> None:
    """A variable used in tasks or templates but missing from argument_specs is a typo."""
    import re

    used: set[str] = set()
    for path in [
        *ROLE.glob("tasks/*.yml"),
        *ROLE.glob("templates/*.j2"),
        *ROLE.glob("handlers/*.yml"),
    ]:
        used |= set(re.findall(r"\bkvtier_host_[a-z0-9_]+", path.read_text()))
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    known = set(specs["argument_specs"]["main"]["options"])
    registered = {"kvtier_host_fstrim_unit", "kvtier_host_l3_parent", "kvtier_host_hugetlbfs_unit"}
    assert used - known - registered == set()


@pytest.mark.parametrize(
    ("l2", "pages"), [(0, 0), (1, 1), (2 * tuning.MIB, 1), (3 * tuning.GIB + 1, 1537)]
)
def test_hugepage_count(l2: int, pages: int) -> None:
    assert tuning.nr_hugepages(l2) == pages
    assert tuning.sysctl_values(l2)["vm.nr_hugepages"] == pages
    assert tuning.sysctl_values(l2, hugepages=False)["vm.nr_hugepages"] == 0


def test_hugepage_count_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="l2_bytes must be >= 0"):
        tuning.nr_hugepages(-1)
