"""The served model: a seeded random Llama with a byte-level tokenizer, or a local HF directory.

The default model needs no download, so `kvtier serve` runs on any machine. Its weights are
random, so its text is meaningless; it exists to exercise the cache, not to answer questions.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import ConfigError

# A fixed, deterministic chat template (Jinja, as transformers expects). Every message renders as
# a role marker line, its content and an end marker, so a conversation that grows by whole
# messages re-renders to a prompt whose bytes extend the previous one: that is what makes a
# returning session's prefix hit the cache.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
END_TOKEN = "<|end|>"

# Size of the default model: small enough for 200 concurrent sessions on two CPU cores, with real
# GQA (fewer KV heads than attention heads) so the KV geometry is the interesting kind.
DEFAULT_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
}


@dataclass
class ServedModel:
    """A model, its tokenizer and what generation needs to know about them."""

    model: Any  # a transformers PreTrainedModel
    tokenizer: Any  # a transformers PreTrainedTokenizerFast
    context_tokens: int
    eos_ids: frozenset[int]
    allowed: torch.Tensor | None  # bool mask over the vocab the sampler may pick, or None = all
    name: str
    # the device failover of a model placed across devices (kvtier.server.failover), else None
    devices: Any = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, so token id == byte value."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def byte_tokenizer() -> Any:
    """A byte-level tokenizer built locally: 256 byte tokens (id == byte) plus the end token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=END_TOKEN)
    tok.add_special_tokens({"eos_token": END_TOKEN})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_default(device: str | None = None, seed: int = 0) -> ServedModel:
    """The seeded random Llama; greedy output is deterministic for a given seed and device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        **DEFAULT_SHAPE,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        model: Any = LlamaForCausalLM(config)
    model = model.to(device=dev, dtype=default_dtype(dev)).eval()
    return _wrap(model, tok, name=f"kvtier-random-llama-seed{seed}")


def load_local(path: str | Path, device: str | None = None) -> ServedModel:
    """Load a Hugging Face model directory (weights + tokenizer) from local disk only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(path)
    if not (root / "config.json").is_file():
        raise ConfigError(
            f"--model {root}: no config.json there; pass a local Hugging Face model directory "
            "(one written by save_pretrained), or leave --model out for the built-in model"
        )
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = AutoTokenizer.from_pretrained(root, local_files_only=True)
    if tok.chat_template is None:
        tok.chat_template = CHAT_TEMPLATE
    model: Any = AutoModelForCausalLM.from_pretrained(
        root, local_files_only=True, dtype=default_dtype(dev)
    )
    return _wrap(model.to(dev).eval(), tok, name=str(root.resolve()))


def _wrap(model: Any, tok: Any, name: str) -> ServedModel:
    cfg = model.config
    context = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
    eos: set[int] = set()
    for source in (tok.eos_token_id, getattr(cfg, "eos_token_id", None)):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, (list, tuple)):
            eos.update(int(x) for x in source)
    allowed = None
    if getattr(tok, "chat_template", None) == CHAT_TEMPLATE and len(tok) == 257:
        # The byte tokenizer can emit any byte; random weights would produce invalid UTF-8 whose
        # decoded text does not re-encode to the same ids. Restricting sampling to printable
        # ASCII (+ newline + end) keeps the reply text round-trippable, so a session's next turn
        # finds its own reply in the cache.
        mask = torch.zeros(len(tok), dtype=torch.bool)
        mask[32:127] = True
        mask[10] = True
        mask[list(eos)] = True
        allowed = mask.to(next(model.parameters()).device)
    return ServedModel(model, tok, context, frozenset(eos), allowed, name)


_CACHE_KWARG: dict[type, str] = {}


def cache_kwarg(model: Any) -> str:
    """Name of the forward() argument that takes the KV cache (`cache` in newer transformers)."""
    cls = type(model)
    if cls not in _CACHE_KWARG:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[cls]
