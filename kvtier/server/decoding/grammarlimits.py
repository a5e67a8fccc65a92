"""What a request's grammar may cost to compile, checked before it is compiled.

xgrammar's compile time grows with what a schema expands to, not with its size: a 40-byte
`{"type": "string", "pattern": "[a-z]{12000}"}` took 6 s on a 152k-token vocabulary, about
quadratically in the count (16 s at 20,000), and an enum of 20,000 values 15 s. So a schema is
refused (400, naming the limit and its flag) when its text, the repetitions any of its patterns
asks for (nested counts multiplied), or its enum and const values in total pass the limits.
A schema within them still gets `timeout` seconds to compile (kvtier.server.decoding.grammar).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvtier.errors import InvalidRequest
from kvtier.server.config import ServerConfig

_COUNT = re.compile(r"\{(\d*)(?:,(\d*))?\}")


@dataclass(frozen=True)
class GrammarLimits:
    """The server's grammar settings (`--grammar-*`; docs/security.md, "Limits")."""

    max_schema_bytes: int = 64 * 2**10
    max_repeat: int = 1000  # a pattern's bounded repetitions (`{n}`, nested ones multiplied)
    max_enum: int = 1024  # enum and const values of one schema, in total
    timeout: float = 10.0  # seconds a request waits for its grammar (queue and compile)
    threads: int = 2  # compiles at once, on threads of their own
    cache_bytes: int = 128 * 2**20  # compiled grammars kept, by their size

    @classmethod
    def from_config(cls, config: ServerConfig) -> GrammarLimits:
        return cls(
            max_schema_bytes=config.grammar_max_schema_bytes,
            max_repeat=config.grammar_max_repeat,
            max_enum=config.grammar_max_enum,
            timeout=config.grammar_timeout,
            threads=config.grammar_threads,
            cache_bytes=config.grammar_cache_bytes,
        )


def check_schema(text: str, limits: GrammarLimits) -> None:
    """Raise InvalidRequest when the JSON Schema `text` passes `limits`."""
    size = len(text.encode())
    if size > limits.max_schema_bytes:
        raise InvalidRequest(
            f"the JSON schema is {size} bytes; this server compiles schemas of at most "
            f"{limits.max_schema_bytes} bytes (--grammar-max-schema-bytes)"
        )
    values = 0
    stack: list[Any] = [json.loads(text)]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        enum = node.get("enum")
        values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            repeat = pattern_repeat(pattern)
            if repeat > limits.max_repeat:
                raise InvalidRequest(
                    f"the JSON schema's pattern {pattern[:60]!r} repeats {repeat} times; this "
                    f"server compiles patterns of at most {limits.max_repeat} repetitions "
                    "(--grammar-max-repeat): use a shorter count, or `maxLength`"
                )
        stack.extend(v for k, v in node.items() if k not in ("enum", "const"))
    if values > limits.max_enum:
        raise InvalidRequest(
            f"the JSON schema has {values} enum and const values; this server compiles at "
            f"most {limits.max_enum} (--grammar-max-enum)"
        )


def pattern_repeat(pattern: str) -> int:
    """The largest bounded repetition `pattern` asks for: `{n}` and `{n,m}` counts of an
    atom, a group's multiplied by the counts inside it. Unbounded `*` and `+` are loops of a
    grammar, cheap to compile, and count 1."""
    groups = [1]  # the largest count inside each open group
    last = 1  # the count of the atom before a quantifier
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i, last = i + 2, 1
            continue
        if c == "[":  # a class is one atom: skip to its closing bracket
            j = i + 1 + (pattern[i + 1 : i + 2] == "]")
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i, last = j + 1, 1
            continue
        if c == "(":
            groups.append(1)
            i, last = i + 1, 1
            continue
        if c == ")":
            inner = groups.pop() if len(groups) > 1 else 1
            groups[-1] = max(groups[-1], inner)
            i, last = i + 1, inner
            continue
        m = _COUNT.match(pattern, i) if c == "{" else None
        if m is not None and (m.group(1) or m.group(2)):
            count = max(int(x) for x in m.groups() if x)
            last *= max(count, 1)
            groups[-1] = max(groups[-1], last)
            i = m.end()
            continue
        i, last = i + 1, 1
    return max(groups)
