"""Structured output's grammars: limits checked before a compile, a deadline, compiles dropped
when no request waits for them, a byte-bounded LRU, errors without xgrammar's build paths, and
replies that keep the schema's key order (CPU, the server's byte tokenizer)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from test_batching import _build, _config, _one, _prompts, _run
from test_structured_output import _grammar_job

from kvtier.errors import InvalidRequest
from kvtier.server.backend import RecomputeBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.decoding.grammar import GrammarBook, GrammarSpec, spec_of
from kvtier.server.decoding.grammarlimits import GrammarLimits, check_schema, pattern_repeat
from kvtier.server.devices.model import byte_tokenizer
from kvtier.server.metrics import ServerMetrics

xgrammar = pytest.importorskip("xgrammar")


def _book(**limits: Any) -> GrammarBook:
    tok = byte_tokenizer()
    return GrammarBook(tok, len(tok), frozenset({tok.eos_token_id}), GrammarLimits(**limits))


def _schema(schema: dict[str, Any]) -> GrammarSpec:
    spec = spec_of({"type": "json_schema", "json_schema": {"schema": schema}}, None, None, True)
    assert spec is not None
    return spec


def test_pattern_repeat_multiplies_nested_counts() -> None:
    assert pattern_repeat("[a-z]{12000}") == 12000
    assert pattern_repeat("^(ab{10}){20}$") == 200
    assert pattern_repeat("((x{3}){4}){5}") == 60
    assert pattern_repeat("a{2,50}b{7,}") == 50
    assert pattern_repeat("[{]{9}\\{100}") == 9  # a class's and an escaped brace are atoms
    assert pattern_repeat("[a-z]+@[a-z]*") == 1  # unbounded loops are cheap


def test_hostile_schemas_are_refused_before_compiling_and_name_their_flag() -> None:
    limits = GrammarLimits()
    cases = {
        "--grammar-max-repeat": {"type": "string", "pattern": "[a-z]{12000}"},
        "--grammar-max-enum": {"enum": list(range(2_000))},
        "--grammar-max-schema-bytes": {"description": "x" * 70_000},
    }
    for flag, schema in cases.items():
        with pytest.raises(InvalidRequest, match=flag):
            check_schema(json.dumps(schema), limits)
    nested = {"type": "array", "items": {"enum": list(range(600))}, "anyOf": [{"enum": [1] * 600}]}
    with pytest.raises(InvalidRequest, match="1200 enum"):  # counted over the whole schema
        check_schema(json.dumps(nested), limits)
    book = _book()
    start = time.perf_counter()
    with pytest.raises(InvalidRequest, match="--grammar-max-repeat"):
        book.compile(_schema(cases["--grammar-max-repeat"]))
    assert time.perf_counter() - start < 0.5  # refused, not compiled for seconds
    check_schema(json.dumps({"type": "string", "pattern": "[a-z]{1000}"}), limits)  # allowed


def test_a_compile_past_its_deadline_is_a_clear_error_and_a_cached_lookup_never_waits() -> None:
    book = _book(max_repeat=100_000, timeout=0.2, threads=1)
    cheap = _schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    book.compile(cheap)
    slow = _schema({"type": "string", "pattern": "[a-z]{5000}"})  # about 1 s here
    with pytest.raises(InvalidRequest, match=r"did not compile within 0\.2 s"):
        book.compile(slow)
    # the slow compile still runs on the book's one thread: a cached grammar comes at once
    start = time.perf_counter()
    book.compile(cheap)
    assert time.perf_counter() - start < 0.05


def test_a_queued_compile_is_dropped_when_its_client_leaves() -> None:
    book = _book(max_repeat=100_000, timeout=30, threads=1)
    busy = _schema({"type": "string", "pattern": "[a-z]{4000}"})
    queued = _schema({"type": "string", "pattern": "[b-y]{3000}"})

    async def main() -> None:
        first = asyncio.ensure_future(book.compiled(busy))
        await asyncio.sleep(0.05)  # the book's one thread is compiling `busy`

        async def gone() -> None:
            await asyncio.sleep(0.05)

        with pytest.raises(InvalidRequest, match="client closed the connection"):
            await book.compiled(queued, gone)
        await first

    asyncio.run(main())
    time.sleep(0.3)
    assert busy in book and queued not in book  # never compiled: no one waited for it


def test_the_compiled_grammar_cache_is_bounded_by_bytes_and_reported() -> None:
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    tok = byte_tokenizer()
    book = GrammarBook(
        tok, len(tok), frozenset({tok.eos_token_id}), GrammarLimits(cache_bytes=400_000), metrics
    )
    sizes = []
    for i in range(12):  # each about 60-100 KB
        book.compile(_schema({"enum": [f"value-{i}-{j}" for j in range(700)]}))
        sizes.append(book.cache_bytes)
    assert max(sizes) <= 400_000
    assert 1 < len(book) < 12  # the least recent were dropped
    assert book.cache_bytes == registry.get_sample_value("kvtier_server_grammar_cache_bytes")
    assert len(book) == registry.get_sample_value("kvtier_server_grammar_cache_entries")
    last = _schema({"enum": [f"value-11-{j}" for j in range(700)]})
    assert last in book


def test_xgrammar_errors_reach_the_client_without_build_paths() -> None:
    """xgrammar says `[14:26:23] /project/cpp/json_schema_converter.cc:5082: Unsupported type
    "foo"`: the client reads what is wrong, not where in xgrammar's sources."""
    book = _book()
    for schema, said in [
        ({"type": "foo"}, 'Unsupported type "foo"'),
        ({"type": "string", "pattern": "["}, "Unclosed '['"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            book.compile(_schema(schema))
        text = str(err.value)
        assert text.startswith("the JSON schema cannot be used: ") and said in text, text
        assert ".cc" not in text and "/project" not in text and "[1" not in text, text


def test_a_json_schema_reply_keeps_the_schemas_property_order(tmp_path: Path) -> None:
    """`name, age` in the schema: `{"name": ..., "age": ...}` in the reply (OpenAI's and vLLM's
    order, which agents rely on), and the same properties in another order are another
    grammar, not a cache hit."""
    served = _build("llama")
    backend = RecomputeBackend(served.model)
    sched = BatchScheduler(served, backend, _config(tmp_path))
    from kvtier.server.http.completions import grammar_book

    book = grammar_book(served)
    props = {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    }
    forward = {"type": "object", "properties": props, "required": ["name", "age"]}
    backward = {**forward, "properties": dict(reversed(props.items()))}
    backward["required"] = ["age", "name"]
    assert _schema(forward) != _schema(backward)
    try:
        prompts = _prompts(5, [20, 30])
        a, b = _run(
            sched,
            _one(sched, _grammar_job(book, "f", prompts[0], forward)),
            _one(sched, _grammar_job(book, "b", prompts[1], backward)),
        )
    finally:
        sched.close()
        backend.close()
    assert list(json.loads(a.text)) == ["name", "age"]
    assert list(json.loads(b.text)) == ["age", "name"]


def test_concurrent_requests_for_one_spec_share_one_compile() -> None:
    book = _book(max_repeat=100_000, threads=2)
    spec = _schema({"type": "string", "pattern": "[a-z]{2500}"})
    out: list[Any] = []
    threads = [threading.Thread(target=lambda: out.append(book.compile(spec))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 4 and all(o is out[0] for o in out)
