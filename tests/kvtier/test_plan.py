"""`kvtier plan` on the sample model configs the repo ships (configs/models/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli.plan import command
from kvtier.geometry import KVGeometry
from kvtier.humanize import size as _fmt
from kvtier.server.devices.memplan import offline_plan

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"
# Published architectures: layers x KV heads x head dim x 2 (K and V) x 2 bytes (bf16).
SHIPPED = {
    "llama-3-8b": (32, 8, 128, 131_072),
    "qwen2-7b": (28, 4, 128, 57_344),
    "mistral-7b": (32, 8, 128, 131_072),
}


def plan(*args: str) -> str:
    """`kvtier plan ARGS` at a context every shipped model's plan holds on 24 GiB (an 8B model's
    32K context does not, beside its weights and the CUDA context)."""
    if "--max-model-len" not in args:
        args = (*args, "--max-model-len", "16384")
    out = CliRunner().invoke(command, list(args))
    assert out.exit_code == 0, out.output
    return out.output


def test_every_shipped_config_is_tested() -> None:
    assert sorted(p.name for p in MODELS.iterdir() if p.is_dir()) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_plan_on_shipped_config(name: str) -> None:
    layers, kv_heads, head_dim, per_token = SHIPPED[name]
    assert layers * kv_heads * head_dim * 2 * 2 == per_token
    g = KVGeometry.from_config(json.loads((MODELS / name / "config.json").read_text()))
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype) == (
        layers,
        kv_heads,
        head_dim,
        "bfloat16",
    )
    assert g.bytes_per_token == per_token
    # The directory and its config.json give the same plan.
    by_dir = plan("--model", str(MODELS / name), "--sessions", "100")
    assert by_dir == plan("--model", str(MODELS / name / "config.json"), "--sessions", "100")
    assert f"{per_token} bytes/token" in by_dir
    chunk = per_token * 256
    assert f"{chunk / 2**20:.1f} MiB per 256-token chunk" in by_dir
    # L1 is the page pool the GPU memory plan leaves of 24 GiB at 0.9, after the weights;
    # 3000 tokens are 12 chunks of 256: the pool holds pool // (12 chunks) sessions.
    config = json.loads((MODELS / name / "config.json").read_text())
    pool = offline_plan(config, g, 24 << 30, 0.9, 64, 1024, 512, 256, 16384).pool
    assert 0 < pool < (24 << 30) - 13 * 10**9  # the weights (7-8 B parameters) are not KV
    assert f"{'L1':4} {_fmt(pool):>12} {pool // (12 * chunk):>13}" in by_dir
    assert (
        f"  {'pool (L1)':12} {_fmt(pool):>12}\n" in by_dir
    )  # the same pool, in the GPU memory plan


def test_plan_refuses_what_serve_would_and_says_what_fits() -> None:
    """Qwen2-7B's 131,072-token context: one such session does not fit the pool 24 GiB at 0.9
    leaves after the weights, as `kvtier serve` would refuse; the sessions table still prints,
    its L1 empty, and the error says what fits."""
    out = CliRunner().invoke(command, ["--model", str(MODELS / "qwen2-7b")])
    assert out.exit_code == 1, out.output
    assert f"{'L1':4} {'-':>12} {0:>13}" in out.output
    assert "Error: L1: " in out.output and "--max-model-len" in out.output


def test_plan_reads_counts_in_words() -> None:
    out = plan("--model", str(MODELS / "qwen2-7b"), "--sessions", "1", "--avg-tokens", "1")
    assert "one session of 1 token: 1 chunk, 14.0 MiB; 1 session: 14.0 MiB" in out
    assert "1 chunks" not in out and "1 sessions" not in out


def test_plan_names_a_directory_without_config(tmp_path: Path) -> None:
    out = CliRunner().invoke(command, ["--model", str(tmp_path)])
    assert out.exit_code == 2 and "holds no config.json" in out.output
    (tmp_path / "config.json").write_text("[1, 2]")
    out = CliRunner().invoke(command, ["--model", str(tmp_path)])
    assert out.exit_code == 2 and "not a JSON object" in out.output


def test_quickstart_example_is_what_plan_prints() -> None:
    doc = (MODELS.parents[1] / "docs" / "quickstart.md").read_text()
    section = doc.split("## Sizing the tiers", 1)[1]
    command_line = section.split("```bash\n", 1)[1].split("```", 1)[0]
    shown = section.split("```text\n", 1)[1].split("```", 1)[0]
    args = command_line.replace("\\\n", " ").split()
    assert args[:2] == ["kvtier", "plan"]
    args = [str(MODELS.parents[1] / a) if a.startswith("configs/") else a for a in args[2:]]
    assert plan(*args) == shown


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_plan_prints_a_serve_table_that_loads(name: str, tmp_path: Path) -> None:
    """Every key `kvtier plan` tells to configure is one `kvtier serve --config` reads."""
    from kvtier.server.config import ServerConfig

    args = ["--model", str(MODELS / name), "--sessions", "100", "--l3-max-bytes", "10GiB"]
    out = plan(*args)
    table = out[out.index("[serve]\n") :]
    toml = tmp_path / "kvtier.toml"
    toml.write_text(table)
    cfg = ServerConfig.load(env={}, file=toml)
    need = 100 * 12 * SHIPPED[name][3] * 256
    assert (cfg.l2_bytes, cfg.l3_max_bytes) == (need, 10 << 30)
    # Paged L1 (the default) sizes L1 from the GPU memory plan: the table leaves it automatic.
    assert cfg.paged_l1 and cfg.l1_bytes == 0
    assert "l3_bytes" not in out
