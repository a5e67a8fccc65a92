"""KV geometry against published model configs (copied from their config.json files)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry, model_fingerprint, parse_size

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "hidden_size": 2048,
    "kv_lora_rank": 512,
    "model_type": "deepseek_v2",
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
}
FALCON_7B = {  # multi-query attention, old-style names
    "hidden_size": 4544,
    "model_type": "falcon",
    "multi_query": True,
    "n_head": 71,
    "n_layer": 32,
    "torch_dtype": "bfloat16",
}
GEMMA3_4B = {  # multimodal: the language model sits under text_config
    "model_type": "gemma3",
    "text_config": {
        "head_dim": 256,
        "hidden_size": 2560,
        "num_attention_heads": 8,
        "num_hidden_layers": 34,
        "num_key_value_heads": 4,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    },
    "torch_dtype": "bfloat16",
}


def test_llama3_8b() -> None:
    g = KVGeometry.from_config(LLAMA3_8B)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.v_head_dim) == (32, 8, 128, 128)
    assert (g.dtype, g.attention, g.sliding_window, g.sliding_layers) == (
        "bfloat16",
        "gqa",
        None,
        (),
    )
    assert g.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert g.chunk_bytes(256) == 33_554_432
    assert g.chunk_shape(256) == (32, 2, 256, 8, 128)


def test_qwen2_7b_is_57344_bytes_per_token_not_the_hidden_size_formula() -> None:
    g = KVGeometry.from_config(QWEN2_7B)
    assert g.bytes_per_token == 57344
    assert g.bytes_per_token != 2 * 28 * 3584 * 2
    assert g.attention == "gqa"
    assert g.sliding_window is None and g.sliding_layers == ()  # use_sliding_window: false


def test_mistral_7b_slides_on_every_layer() -> None:
    g = KVGeometry.from_config(MISTRAL_7B_V01)
    assert g.bytes_per_token == 131072
    assert g.sliding_window == 4096
    assert g.sliding_layers == tuple(range(32))


def test_deepseek_v2_lite_mla_stores_the_latent() -> None:
    g = KVGeometry.from_config(DEEPSEEK_V2_LITE)
    assert (g.attention, g.num_kv_heads, g.head_dim, g.v_head_dim) == ("mla", 1, 576, 0)
    assert g.bytes_per_token == 27 * (512 + 64) * 2 == 31104
    assert g.kv_planes == 1
    assert g.chunk_shape(4) == (27, 1, 4, 1, 576)
    assert g.chunk_bytes(4) == 4 * 31104


def test_falcon_multi_query() -> None:
    g = KVGeometry.from_config(FALCON_7B)
    assert (g.attention, g.num_kv_heads, g.head_dim) == ("mqa", 1, 64)
    assert g.bytes_per_token == 2 * 32 * 64 * 2


def test_gemma3_nested_text_config_and_sliding_pattern() -> None:
    g = KVGeometry.from_config(GEMMA3_4B)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype) == (34, 4, 256, "bfloat16")
    assert g.sliding_window == 1024
    full = [i for i in range(34) if i not in g.sliding_layers]
    assert full == [5, 11, 17, 23, 29]


def test_layer_types_list() -> None:
    cfg = dict(LLAMA3_8B, num_hidden_layers=4, sliding_window=512)
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * 2
    g = KVGeometry.from_config(cfg)
    assert g.sliding_layers == (0, 2) and g.sliding_window == 512


def test_dtype_override_and_spellings() -> None:
    assert KVGeometry.from_config(LLAMA3_8B, dtype="float32").bytes_per_token == 262144
    assert KVGeometry.from_config(dict(LLAMA3_8B, torch_dtype="torch.float16")).dtype == "float16"
    assert KVGeometry.from_config(dict(LLAMA3_8B, torch_dtype=None)).dtype == "float32"
    with pytest.raises(ConfigError, match="int4"):
        KVGeometry.from_config(LLAMA3_8B, dtype="int4")


def test_transformers_config_objects_match_the_dicts() -> None:
    from transformers import LlamaConfig, Qwen2Config

    for cls, raw in ((LlamaConfig, LLAMA3_8B), (Qwen2Config, QWEN2_7B)):
        obj = cls(**raw)
        assert KVGeometry.from_config(obj, dtype="bfloat16") == KVGeometry.from_config(raw)
        g = KVGeometry.from_config(raw)
        fp_obj = model_fingerprint(obj, g, model_id="m", codec="native")
        assert fp_obj == model_fingerprint(raw, g, model_id="m", codec="native")


def test_dtype_is_read_without_the_torch_dtype_deprecation(
    monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    """transformers logs "`torch_dtype` is deprecated" (once per process) when a config's
    `torch_dtype` is read: the geometry reads `dtype` and never touches the old name."""
    from transformers import LlamaConfig
    from transformers.configuration_utils import logger

    said: list[str] = []
    monkeypatch.setattr(logger, "warning_once", lambda msg, *a, **k: said.append(str(msg)))
    monkeypatch.setattr(logger, "warning", lambda msg, *a, **k: said.append(str(msg)))
    raw = {k: v for k, v in LLAMA3_8B.items() if k != "torch_dtype"}
    for obj, dtype in (
        (LlamaConfig(**raw), "float32"),  # no dtype at all: the default
        (LlamaConfig(**raw, dtype="float16"), "float16"),
        (LlamaConfig(**raw, torch_dtype="bfloat16"), "bfloat16"),  # an old config.json
    ):
        assert KVGeometry.from_config(obj).dtype == dtype
    assert not [m for m in said if "torch_dtype" in m], said
    assert not [w for w in recwarn if "torch_dtype" in str(w.message)]
    # config.json dicts: `dtype` first, `torch_dtype` where only it is named
    assert KVGeometry.from_config(dict(raw, dtype="float16", torch_dtype="bfloat16")).dtype == (
        "float16"
    )
    assert KVGeometry.from_config(dict(raw, torch_dtype="float16")).dtype == "float16"


def test_bad_configs_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        KVGeometry.from_config({"hidden_size": 4})
    with pytest.raises(ConfigError, match="head_dim"):
        KVGeometry.from_config({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 8})
    with pytest.raises(ConfigError, match="v_head_dim"):
        KVGeometry(2, 2, 64, 0, "bfloat16", "gqa")
    with pytest.raises(ConfigError, match="sliding_layers"):
        KVGeometry(2, 2, 64, 64, "bfloat16", "gqa", 16, (5,))
    with pytest.raises(ConfigError, match="equal dims"):
        KVGeometry(2, 2, 64, 32, "bfloat16", "gqa").chunk_shape(1)


def test_fingerprint_covers_what_makes_kv_incompatible() -> None:
    g = KVGeometry.from_config(LLAMA3_8B)
    base = model_fingerprint(LLAMA3_8B, g, model_id="llama3", codec="native")
    assert len(base) == 16
    variants = [
        model_fingerprint(LLAMA3_8B, g, model_id="llama3-ft", codec="native"),
        model_fingerprint(LLAMA3_8B, g, model_id="llama3", codec="int8"),
        model_fingerprint(LLAMA3_8B, g, model_id="llama3", codec="native", weights_digest=b"w"),
        model_fingerprint(dict(LLAMA3_8B, rope_theta=1e6), g, model_id="llama3", codec="native"),
        model_fingerprint(
            dict(LLAMA3_8B, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            g,
            model_id="llama3",
            codec="native",
        ),
    ]
    for cfg in (dict(LLAMA3_8B, num_key_value_heads=4), dict(LLAMA3_8B, torch_dtype="float16")):
        variants.append(
            model_fingerprint(cfg, KVGeometry.from_config(cfg), model_id="llama3", codec="native")
        )
    variants.append(
        model_fingerprint(
            MISTRAL_7B_V01,
            KVGeometry.from_config(MISTRAL_7B_V01),
            model_id="llama3",
            codec="native",
        )
    )
    assert len({base, *variants}) == len(variants) + 1
    # Config keys that do not touch KV leave it alone; "type" and "rope_type" are one thing.
    assert (
        model_fingerprint(dict(LLAMA3_8B, vocab_size=7), g, model_id="llama3", codec="native")
        == base
    )
    a = dict(LLAMA3_8B, rope_scaling={"type": "linear", "factor": 2.0})
    b = dict(LLAMA3_8B, rope_scaling={"rope_type": "linear", "factor": 2})
    assert model_fingerprint(a, g, model_id="x", codec="native") == model_fingerprint(
        b, g, model_id="x", codec="native"
    )


def test_fingerprint_is_stable_across_processes() -> None:
    code = (
        "from kvtier.geometry import KVGeometry, model_fingerprint\n"
        "cfg = {'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2,"
        " 'hidden_size': 64, 'rope_theta': 10000.0}\n"
        "g = KVGeometry.from_config(cfg)\n"
        "print(model_fingerprint(cfg, g, model_id='tiny', codec='native').hex())\n"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(runs) == 1 and len(runs.pop()) == 32


def test_geometry_does_not_import_torch() -> None:
    code = "import sys, kvtier.geometry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        (" 8 kib ", 8192),
        ("2T", 2 * 10**12),
        (4096, 4096),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-1GiB", "1e999", "0x10"])
def test_parse_size_rejects_with_a_hint(text: str) -> None:
    with pytest.raises(ConfigError, match=r"512MiB|finite"):
        parse_size(text)


def test_plan_command(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from click.testing import CliRunner

    from kvtier.cli.plan import command

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN2_7B))
    args = ["--model", str(cfg), "--sessions", "100", "--avg-tokens", "3000"]
    out = CliRunner().invoke(command, [*args, "--gpu-mem", "24GiB", "--max-model-len", "32768"])
    assert out.exit_code == 0, out.output
    assert "57344 bytes/token" in out.output
    # L1 is the page pool left after the CUDA context, 14.2 GiB of weights and the rest: 12
    # chunks of 14 MiB per session, not the 146 sessions the whole 24 GiB would hold
    assert "L1        4.9 GiB            30" in out.output
    bad = CliRunner().invoke(command, [*args, "--gpu-mem", "lots"])
    assert bad.exit_code != 0 and "512MiB" in bad.output
