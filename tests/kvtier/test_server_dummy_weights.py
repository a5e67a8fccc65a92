"""`--load-format dummy`: a model from its config.json alone, with random weights.

The directory holds a config.json (and maybe a tokenizer), no weights: the model of that shape
is built with seeded random weights directly in its serving dtype on its device, with the
directory's tokenizer or else the built-in byte tokenizer, and the server serves it like any
other. Prompts only ever hold ids the model embeds: a tokenizer with an entry more than the
model has embeddings (258 against 257) neither breaks the warm-up nor reaches the model.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from kvtier.server.config import ServerConfig
from kvtier.server.devices.model import load_dummy
from kvtier.server.http.app import _load, create_app
from kvtier.server.run import load_config

VOCAB = 257  # the byte tokenizer's: 256 bytes and the end token


def _config_dir(root: Path, kind: str = "qwen2", vocab: int = VOCAB) -> Path:
    """A model directory holding only its config.json."""
    from transformers import LlamaConfig, Qwen2Config

    shape: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,  # a short warm-up
    )
    config = Qwen2Config(**shape) if kind == "qwen2" else LlamaConfig(**shape)
    root.mkdir()
    config.save_pretrained(root)
    assert sorted(p.name for p in root.iterdir()) == ["config.json"]
    return root


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_dummy_builds_the_config_in_float32_on_the_cpu(tmp_path: Path, kind: str) -> None:
    root = _config_dir(tmp_path / "model", kind)
    served = load_dummy(root, "cpu", seed=1)
    model = served.model
    assert type(model).__name__ == ("Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM")
    assert len(model.model.layers) == 3 and model.config.hidden_size == 64
    assert model.get_input_embeddings().num_embeddings == VOCAB
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert not model.training
    # the built-in byte tokenizer (the directory has none), its sampling kept to printable text
    tok = served.tokenizer
    assert len(tok) == VOCAB and tok.encode("A", add_special_tokens=False) == [65]
    assert served.vocab_size == VOCAB and served.allowed is not None
    assert served.context_tokens == 512
    # seeded: the same seed gives the same weights, another seed others
    same, other = load_dummy(root, "cpu", seed=1).model, load_dummy(root, "cpu", seed=2).model
    w = model.get_input_embeddings().weight
    assert torch.equal(w, same.get_input_embeddings().weight)
    assert not torch.equal(w, other.get_input_embeddings().weight)
    # the server's loader takes that path for --load-format dummy
    config = ServerConfig(model=root, load_format="dummy", device="cpu", seed=1)
    loaded = _load(config)
    assert torch.equal(loaded.model.get_input_embeddings().weight, w)


def test_a_directory_with_only_config_json_passes_the_start_check(tmp_path: Path) -> None:
    root = _config_dir(tmp_path / "model")
    flags = {"model": root, "load_format": "dummy", "l3_root": tmp_path / "l3"}
    config = load_config(flags)
    assert config.model == root and config.load_format == "dummy"


@contextlib.contextmanager
def _served(config: ServerConfig, timeout: float = 120.0) -> Iterator[TestClient]:
    with TestClient(create_app(config)) as client:
        state = client.app.state.kvtier  # type: ignore[attr-defined]
        deadline = time.monotonic() + timeout
        while client.get("/readyz").status_code != 200:
            assert state.load_error is None, state.load_error
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.05)
        yield client


def _chat(client: TestClient, text: str) -> Any:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,
    }
    return client.post("/v1/chat/completions", json=body)


def _config(root: Path, l3: Path) -> ServerConfig:
    return ServerConfig(
        model=root,
        load_format="dummy",
        l3_root=l3,
        device="cpu",
        l2_bytes=32 * 2**20,
        l3_writer="threads",
        log_level="warning",
    )


def test_a_chat_through_the_app_on_dummy_weights(tmp_path: Path) -> None:
    root = _config_dir(tmp_path / "model")
    with _served(_config(root, tmp_path / "l3")) as client:
        r = _chat(client, "hello")
        assert r.status_code == 200, r.text
        body = r.json()
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["usage"]["completion_tokens"] >= 1


def test_a_tokenizer_longer_than_the_embeddings_warms_up_and_serves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The directory's tokenizer has 258 entries (the byte tokenizer and a pad token), its
    config 257 embeddings: prompts the warm-up makes stay below 257 (an id of 257 is an
    IndexError on the CPU, a device-side assert on CUDA), and a request whose text encodes to
    id 257 gets a 400 instead of reaching the model."""
    from kvtier.server.devices.model import byte_tokenizer

    root = _config_dir(tmp_path / "model", "llama")
    tok = byte_tokenizer()
    tok.add_special_tokens({"pad_token": "<|pad|>"})
    tok.save_pretrained(root)
    assert len(tok) == VOCAB + 1
    caplog.set_level(logging.INFO, logger="kvtier.server")
    with _served(_config(root, tmp_path / "l3")) as client:
        engine = client.app.state.kvtier.engine  # type: ignore[attr-defined]
        served = engine.served
        assert len(served.tokenizer) == VOCAB + 1 and served.vocab_size == VOCAB
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert warnings == [], warnings  # the warm-up through the cache and its request ran
        assert any("warm-up request served" in r.getMessage() for r in caplog.records)
        assert engine.backend.prefill_estimate().samples >= 1  # measured by the warm-up
        r = _chat(client, "hello")
        assert r.status_code == 200, r.text
        r = _chat(client, "hello <|pad|>")
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "token id 257" in error["message"] and error["param"] == "messages", error
        assert _chat(client, "still serving").status_code == 200
