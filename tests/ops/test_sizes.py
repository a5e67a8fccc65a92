"""One meaning of a size everywhere: serve (flags, environment, TOML), plan, doctor and `l3 gc`.

`2G` is 2,000,000,000 bytes and `2Gi` 2,147,483,648 at every entry point (kvtier.units); `l3 gc`
used to read `2G` as 2 GiB while the others read it as 2 GB.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvtier import geometry, units
from kvtier.errors import ConfigError
from kvtier.server import config as server_config
from kvtier.server.config import ServerConfig
from kvtier.units import SizeError, parse_size

CASES = [
    ("2G", 2 * 10**9),
    ("2Gi", 2 * 2**30),
    ("2GB", 2 * 10**9),
    ("2GiB", 2 * 2**30),
    ("512k", 512_000),
    ("512KiB", 512 * 1024),
    ("1.5M", 1_500_000),
    ("3 t", 3 * 10**12),
    ("4096", 4096),
    ("7b", 7),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected
    # the old names are the same function
    assert geometry.parse_size(text) == server_config.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "lots", "12 parsecs", "-1G", "0x10", "1e999", "2Gb x"])
def test_junk_is_a_typed_error_listing_the_forms(text: str) -> None:
    with pytest.raises(SizeError, match=r"Ki/Mi/Gi/Ti.*powers of 1024") as info:
        parse_size(text, "l2_bytes")
    assert isinstance(info.value, ConfigError) and "l2_bytes" in str(info.value)


def test_server_config_reads_sizes_the_same_way(tmp_path: Path) -> None:
    toml = tmp_path / "kvtier.toml"
    toml.write_text('[serve]\nl1_bytes = "2G"\n')
    env = {"KVTIER_L2_BYTES": "2Gi", "KVTIER_MAX_BODY_BYTES": "1M"}
    cfg = ServerConfig.load(env=env, file=toml)
    assert (cfg.l1_bytes, cfg.l2_bytes, cfg.max_body_bytes) == (2 * 10**9, 2 * 2**30, 10**6)
    assert ServerConfig.load(flags={"l1_bytes": "2G"}, env={}).l1_bytes == 2 * 10**9


def test_plan_reads_sizes_the_same_way(tmp_path: Path) -> None:
    from kvtier.cli.plan import command

    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "torch_dtype": "float16",
            }
        )
    )
    args = ["--model", str(cfg), "--sessions", "100000", "--avg-tokens", "4096"]
    out = CliRunner().invoke(command, [*args, "--l2-bytes", "2G", "--l3-max-bytes", "2Gi"])
    assert out.exit_code == 0, out.output
    assert f"l2_bytes = {2 * 10**9} " in out.output
    assert f"l3_max_bytes = {2 * 2**30} " in out.output
    # the old spellings still work, and a bad size is worded as in every command
    old = CliRunner().invoke(command, [*args, "--host-mem", "2G", "--ssd", "2Gi"])
    assert old.output == out.output
    bad = CliRunner().invoke(command, [*args, "--ssd", "lots"])
    assert bad.exit_code == 2
    assert "Invalid value for '--l3-max-bytes': cannot read size 'lots'; write" in bad.output


def test_doctor_reads_sizes_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ops import doctor
    from ops.commands.doctor import command

    seen: list[Any] = []
    real = doctor.collect

    def collect(**kw: Any) -> Any:
        seen.append(kw["l2_bytes"])
        return real(**kw)

    monkeypatch.setattr(doctor, "collect", collect)
    for text in ("2G", "2Gi"):
        CliRunner().invoke(command, ["--json", "--l2-size", text, "--l3-root", str(tmp_path)])
    assert seen == [2 * 10**9, 2 * 2**30]


def test_l3_gc_reads_sizes_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.cli.l3 import command
    from kvtier.tiers.l3 import maint as l3_maint

    seen: list[Any] = []
    real = l3_maint.gc

    def gc(store: Any, **kw: Any) -> Any:
        seen.append(kw["max_bytes"])
        return real(store, **kw)

    monkeypatch.setattr(l3_maint, "gc", gc)
    root = tmp_path / "l3"
    for text in ("2G", "2Gi"):
        out = CliRunner().invoke(command, ["gc", "--root", str(root), "--max-bytes", text])
        assert out.exit_code == 0, out.output
    assert seen == [2 * 10**9, 2 * 2**30]
    bad = CliRunner().invoke(command, ["gc", "--root", str(root), "--max-bytes", "lots"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "Invalid value for '--max-bytes': cannot read size 'lots'; write" in bad.output


def test_every_command_words_a_bad_size_the_same_way(tmp_path: Path) -> None:
    """serve, plan and doctor: `Invalid value for '--FLAG': cannot read size ...`, the flag
    named once; serve refuses it before it imports torch (in well under a second)."""
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    model = str(root / "configs" / "models" / "qwen2-7b")
    runs = {
        "serve": ["serve", "--l2-bytes", "12XB"],
        "plan": ["plan", "--model", model, "--l2-bytes", "12XB"],
        "doctor": ["doctor", "--l2-bytes", "12XB", "--l3-root", str(tmp_path)],
    }
    for name, args in runs.items():
        started = time.monotonic()
        env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
        cmd = [sys.executable, "-X", "importtime", "-m", "ops.cli", *args]
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - started
        assert done.returncode == 2, (name, done.stderr[-2000:])
        errors = [ln for ln in done.stderr.splitlines() if ln.startswith("Error:")]
        assert errors == [
            "Error: Invalid value for '--l2-bytes': cannot read size '12XB'; write " + units.FORMS
        ], name
        if name == "serve":
            imported = {ln.split("|")[-1].strip() for ln in done.stderr.splitlines()}
            assert "torch" not in imported and elapsed < 30, elapsed


def test_units_is_the_documented_meaning() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert "2,000,000,000" in doc and "2,147,483,648" in doc
    assert units.__doc__ is not None and "2,147,483,648" in units.__doc__
