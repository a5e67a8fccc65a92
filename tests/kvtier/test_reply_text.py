"""ReplyText: the streamed text of a reply, token by token, equals the decode of the whole reply
(cut at the first stop string), and its cost does not grow with the reply."""

from __future__ import annotations

import random

import pytest

from kvtier.server.decoding.sampling import ReplyText
from kvtier.server.devices.model import byte_tokenizer


def _byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer built locally, as Llama's and Mistral's: pieces with a
    leading-space marker, a character outside the vocabulary as one token per UTF-8 byte, and a
    decoder that strips the text's leading space."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁hello", "▁world", "hel", "lo", ",", "▁", "▁a", "b", "▁€", "x", "."]
    vocab = {p: i for i, p in enumerate(pieces)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    core.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>")


def _stream(tok, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[str, bool]:
    reply = ReplyText(tok, {tok.eos_token_id}, stop)
    out = ""
    for t in ids:
        out += reply.add(t)
        if reply.stopped:
            return out, True
    return out + reply.rest(), False


def test_byte_level_replies_stream_their_whole_decode_invalid_bytes_included() -> None:
    """The server's byte-level tokenizer; a random model emits any byte, so replies hold
    incomplete and invalid UTF-8 sequences, which the decode shows as U+FFFD."""
    tok = byte_tokenizer()
    rng = random.Random(0)
    for trial in range(300):
        ids: list[int] = []
        for _ in range(rng.randrange(1, 200)):
            r = rng.random()
            if r < 0.3:  # part or all of a multi-byte character
                ids += list("é€😀".encode()[rng.randrange(0, 9) :][: rng.randrange(1, 5)])
            elif r < 0.4:
                ids.append(rng.randrange(128, 256))
            else:
                ids.append(rng.randrange(32, 127))
        stop = ("ab", "€x") if trial % 2 else ()
        out, stopped = _stream(tok, ids, stop)
        full = tok.decode(ids, skip_special_tokens=True)
        cuts = [i for i in (full.find(s) for s in stop) if i >= 0]
        assert stopped == bool(cuts)
        assert out == (full[: min(cuts)] if cuts else full), (trial, ids)


def test_byte_fallback_characters_stream_whole() -> None:
    """A character split over byte tokens decodes to one U+FFFD per byte until it is whole:
    none of them may be streamed (the streamed text once gained a stray U+FFFD there), and the
    decoder's leading-space rule holds at every window boundary."""
    tok = _byte_fallback_tokenizer()
    vocab = tok.get_vocab()
    words = [i for p, i in vocab.items() if not p.startswith("<")]
    rng = random.Random(1)
    for trial in range(300):
        ids: list[int] = []
        for _ in range(rng.randrange(1, 120)):
            if rng.random() < 0.3:
                ch = rng.choice(["é", "€", "😀", "q"])
                ids += [vocab[f"<0x{b:02X}>"] for b in ch.encode()]
            else:
                ids.append(rng.choice(words))
        out, _ = _stream(tok, ids)
        assert out == tok.decode(ids, skip_special_tokens=True), (trial, ids)


def test_a_token_decodes_a_bounded_window_however_long_the_reply() -> None:
    tok = byte_tokenizer()
    decoded: list[int] = []
    real = tok.decode

    class Counting:
        def __getattr__(self, name: str):
            return getattr(tok, name)

        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return real(ids, **kw)

    reply = ReplyText(Counting(), {tok.eos_token_id}, ("never",))
    for i in range(2000):
        reply.add(97 + i % 26)
    assert sum(decoded[-200:]) <= 200 * 3 * ReplyText.WINDOW, max(decoded)


@pytest.mark.parametrize("stop", [("xyz",), ("€",)])
def test_a_stop_string_across_tokens_and_windows_is_found(stop: tuple[str, ...]) -> None:
    tok = byte_tokenizer()
    text = "a" * 37 + stop[0] + "tail"
    out, stopped = _stream(tok, list(text.encode()), stop)
    assert stopped and out == "a" * 37
