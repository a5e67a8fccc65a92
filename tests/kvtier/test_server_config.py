"""Server settings: flags > environment > TOML > defaults, and errors that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.server.config import ServerConfig, default_l3_root, parse_size
from kvtier.server.devices.model import build_default, byte_tokenizer


def test_precedence_flags_over_env_over_toml(tmp_path: Path) -> None:
    toml = tmp_path / "kvtier.toml"
    toml.write_text('[serve]\nport = 7000\nmax_concurrency = 3\nl1_bytes = "1GiB"\n')
    env = {"KVTIER_PORT": "7100", "KVTIER_L1_BYTES": "64MiB"}
    cfg = ServerConfig.load(flags={"port": 7200, "host": None}, env=env, file=toml)
    assert cfg.port == 7200  # flag
    assert cfg.l1_bytes == 64 * 2**20  # env beats TOML
    assert cfg.max_concurrency == 3  # TOML beats the default
    assert cfg.host == "127.0.0.1"  # a flag left out (None) does not override
    env_file = {"KVTIER_CONFIG": str(toml)}
    assert ServerConfig.load(env=env_file).port == 7000


@pytest.mark.parametrize(
    ("text", "expected"),
    [("123", 123), ("64MiB", 64 * 2**20), ("2GB", 2 * 10**9), ("1.5KiB", 1536), ("512k", 512000)],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_bad_values_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KVTIER_PORT"):
        ServerConfig.load(env={"KVTIER_PORT": "eighty"})
    with pytest.raises(ConfigError, match="l2_bytes"):
        ServerConfig.load(env={"KVTIER_L2_BYTES": "lots"})
    with pytest.raises(ConfigError, match="port"):
        ServerConfig.load(flags={"port": 70000}, env={})
    toml = tmp_path / "bad.toml"
    toml.write_text("[serve]\nprot = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key.*prot"):
        ServerConfig.load(env={}, file=toml)
    with pytest.raises(ConfigError, match="does not exist"):
        ServerConfig.load(env={}, file=tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="l3_writer"):
        ServerConfig.load(env={"KVTIER_L3_WRITER": "fork"})


def test_writer_and_isolation_settings() -> None:
    default = ServerConfig.load(env={})
    assert default.l3_writer == "auto" and default.isolate_cpus is True
    c = ServerConfig.load(env={"KVTIER_L3_WRITER": "process", "KVTIER_ISOLATE_CPUS": "0"})
    assert c.l3_writer == "process" and c.isolate_cpus is False


def test_cudnn_attention_is_off_unless_asked() -> None:
    import torch

    from kvtier.server.http.app import _load

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for wanted in (True, False):
            _load(ServerConfig.load(flags={"cudnn_attention": wanted, "device": "cpu"}, env={}))
            assert torch.backends.cuda.cudnn_sdp_enabled() is wanted
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    assert ServerConfig.load(env={}).cudnn_attention is False
    assert ServerConfig.load(flags={"cudnn_attention": True}, env={}).cudnn_attention is True
    assert ServerConfig.load(env={"KVTIER_CUDNN_ATTENTION": "yes"}).cudnn_attention is True
    with pytest.raises(ConfigError, match="cudnn_attention"):
        ServerConfig.load(env={"KVTIER_CUDNN_ATTENTION": "maybe"})


@pytest.mark.parametrize("home", ["/home/alice", "/tmp/ci-home"])
def test_default_l3_root_is_private_under_user_data_dir(
    home: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default follows the user's data dir (HOME, or XDG_DATA_HOME when set), whatever HOME
    the person running the tests has: a HOME under /tmp is theirs, not a shared /tmp path."""
    monkeypatch.setenv("HOME", home)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    root = default_l3_root()
    assert root == Path(home) / ".local" / "share" / "kvtier" / "l3"
    assert ServerConfig.load(env={}).l3_root == root
    monkeypatch.setenv("XDG_DATA_HOME", "/srv/data")
    assert default_l3_root() == Path("/srv/data/kvtier/l3")
    assert not str(default_l3_root()).startswith("/tmp")


def test_byte_tokenizer_round_trips_every_byte_and_keeps_prefixes() -> None:
    tok = byte_tokenizer()
    text = "héllo wörld\n\t<tag> ✓"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # id == byte value
    assert tok.decode(ids) == text
    a = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    b = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        tokenize=False,
    )
    assert b.startswith(a)  # a growing conversation re-renders to an extension


def test_default_model_is_seeded() -> None:
    a, b, c = build_default("cpu", seed=1), build_default("cpu", seed=1), build_default("cpu", 2)
    wa = next(a.model.parameters())
    assert wa.equal(next(b.model.parameters()))
    assert not wa.equal(next(c.model.parameters()))
    assert a.model.config.num_key_value_heads < a.model.config.num_attention_heads  # GQA


def test_l3_size_cap_reaches_the_store(tmp_path: Path) -> None:
    """`--l3-max-bytes` (and KVTIER_L3_MAX_BYTES, TOML) caps the store the server opens."""
    import os

    from kvtier.server.backend import TieredBackend

    assert ServerConfig.load({}, env={}).l3_max_bytes == 0  # automatic by default:
    auto = ServerConfig.load({"l3_root": str(tmp_path / "auto" / "l3")}, env={})
    backend = TieredBackend(build_default("cpu").model, auto, "auto")
    try:  # half the filesystem that holds L3
        st = os.statvfs(tmp_path)
        assert backend.cache.l3.max_bytes == int(st.f_blocks * st.f_frsize * 0.5)
    finally:
        backend.close()
    assert ServerConfig.load({}, env={"KVTIER_L3_MAX_BYTES": "2G"}).l3_max_bytes == 2 * 10**9
    cfg = ServerConfig.load({"l3_max_bytes": "64MiB", "l3_root": str(tmp_path / "l3")}, env={})
    backend = TieredBackend(build_default("cpu").model, cfg, "capped")
    try:
        assert backend.cache.l3.max_bytes == 64 << 20
    finally:
        backend.close()
    with pytest.raises(ConfigError, match="l3_max_bytes"):
        ServerConfig.load({"l3_max_bytes": "lots"}, env={})


def test_a_public_bind_without_keys_is_refused_unless_insecure_no_auth(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--insecure-no-auth"):
        ServerConfig.load({"host": "0.0.0.0"}, env={})
    with pytest.raises(ConfigError, match="--api-keys"):
        ServerConfig.load({"host": "192.0.2.7"}, env={})
    assert ServerConfig.load({"host": "0.0.0.0", "insecure_no_auth": True}, env={}).host
    for local in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert ServerConfig.load({"host": local}, env={}).host == local
    keys = tmp_path / "keys.json"
    assert ServerConfig.load({"host": "0.0.0.0", "api_keys": str(keys)}, env={}).host
