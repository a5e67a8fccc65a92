"""The served model: a seeded random Llama with a byte-level tokenizer, or a local HF directory.

The default model needs no download, so `kvtier serve` runs on any machine. Its weights are
random, so its text is meaningless; it exists to exercise the cache, not to answer questions.
`--load-format dummy` does the same at a real model's scale: random weights of the shape its
config.json gives, built where they are served (`load_dummy`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import ConfigError, InvalidRequest

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
    # the device failover of a model placed across devices (kvtier.server.devices.failover), else None
    devices: Any = None
    # token ids the model can embed: the smaller of the tokenizer's entries and the input
    # embeddings' rows (0: worked out here). They differ: a tokenizer saved and loaded again
    # can have an entry more than the model has rows, and an id past the rows is a
    # device-side assert on CUDA, which no later call on the device survives
    vocab_size: int = 0
    # the most characters of text one token stands for (kvtier.server.http.prompting): a prompt
    # longer than context x that is refused untokenized; -1: not worked out yet, 0: unknown
    token_chars: int = -1
    # the grammar compiler of its structured output (kvtier.server.decoding.grammar), made on first use
    grammars: Any = None

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            self.vocab_size = embeddable(self.model, self.tokenizer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def check_ids(self, ids: Sequence[int]) -> None:
        """InvalidRequest when a prompt holds a token id the model cannot embed (an entry the
        tokenizer has and the model does not): it is refused here, never reaching the model."""
        top = max(ids, default=0)
        if top >= self.vocab_size:
            raise InvalidRequest(
                f"the prompt holds token id {top}, outside the model's {self.vocab_size} "
                f"token ids (its tokenizer has {len(self.tokenizer)} entries); remove the text "
                "that encodes to it (a special token this model has no embedding for)"
            )


def embeddable(model: Any, tokenizer: Any) -> int:
    """The token ids both the tokenizer and the model's input embeddings have."""
    vocab = len(tokenizer)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    return min(vocab, int(rows)) if rows else vocab


def bytes_to_unicode() -> dict[int, str]:
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

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
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
    from transformers import AutoModelForCausalLM

    root = _model_dir(path)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = _local_tokenizer(root)
    model: Any = AutoModelForCausalLM.from_pretrained(
        root, local_files_only=True, dtype=default_dtype(dev)
    )
    return _wrap(model.to(dev).eval(), tok, name=str(root.resolve()))


def load_dummy(path: str | Path, device: str | None = None, seed: int = 0) -> ServedModel:
    """`--load-format dummy`: the model of `path`'s config.json with seeded random weights, and
    the directory's tokenizer (the built-in byte tokenizer when it holds none). Nothing but
    config.json is read, so a model's full scale runs with no weights downloaded."""
    from transformers import AutoConfig

    root = _model_dir(path)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    has_tokenizer = any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    tok = _local_tokenizer(root) if has_tokenizer else byte_tokenizer()
    config = AutoConfig.from_pretrained(root, local_files_only=True)
    model = random_model(config, dev, default_dtype(dev), seed)
    return _wrap(model, tok, name=f"{root.resolve()} (random weights, seed {seed})")


def random_model(config: Any, device: str | torch.device, dtype: torch.dtype, seed: int) -> Any:
    """A causal LM of `config` with seeded random weights, built in `dtype` on `device`: every
    tensor is made there in its final dtype, with no float32 or host copy on the way (a 7B
    model built in float32 and then cast needed ~45 GB at its peak)."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    forked = [dev] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=forked, device_type=dev.type), dev:
        torch.manual_seed(seed)
        # dtype=: transformers builds the modules under that default dtype (its from_pretrained
        # does the same), so the rotary tables it computes in float32 stay float32
        model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _model_dir(path: str | Path) -> Path:
    root = Path(path)
    if not (root / "config.json").is_file():
        raise ConfigError(
            f"--model {root}: no config.json there; pass a local Hugging Face model directory "
            "(one written by save_pretrained), or leave --model out for the built-in model"
        )
    return root


def _local_tokenizer(root: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root, local_files_only=True)
    if tok.chat_template is None:
        tok.chat_template = CHAT_TEMPLATE
    return tok


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
    vocab = embeddable(model, tok)
    logits = int(getattr(cfg, "vocab_size", 0) or len(tok))
    if getattr(tok, "chat_template", None) == CHAT_TEMPLATE and vocab == 257 <= logits:
        # The byte tokenizer can emit any byte; random weights would produce invalid UTF-8 whose
        # decoded text does not re-encode to the same ids. Restricting sampling to printable
        # ASCII (+ newline + end) keeps the reply text round-trippable, so a session's next turn
        # finds its own reply in the cache. (The mask spans the logits: a saved and reloaded
        # byte tokenizer may have an entry more than the model.)
        mask = torch.zeros(logits, dtype=torch.bool)
        mask[32:127] = True
        mask[10] = True
        mask[[i for i in eos if i < vocab]] = True
        allowed = mask.to(next(model.parameters()).device)
    return ServedModel(model, tok, context, frozenset(eos), allowed, name, vocab_size=vocab)


_CACHE_KWARG: dict[type, str] = {}


def cache_kwarg(model: Any) -> str:
    """Name of the forward() argument that takes the KV cache (`cache` in newer transformers)."""
    cls = type(model)
    if cls not in _CACHE_KWARG:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[cls]
