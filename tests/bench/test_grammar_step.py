"""bench/grammar_step.py, the CPU smoke run: both runs complete, the table has its two rows with
their ratios against the run without the constrained row, and the constrained reply is JSON's
start (a random model's sampled reply, held to the grammar)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import grammar_step  # noqa: E402


def test_cpu_smoke_run_prints_both_rows_and_a_constrained_reply(
    capsys: pytest.CaptureFixture[str],
) -> None:
    grammar_step.main(
        [
            "--shape",
            "qwen2-tiny",
            "--device",
            "cpu",
            "--batch",
            "4",
            "--tokens",
            "16",
            "--repeats",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert "page pool" not in out  # the GPU's device-bytes line only
    rows = {
        m[0]: m[1:]
        for m in re.findall(
            r"^(without|with one constrained row)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out, re.M
        )
    }
    assert set(rows) == {"without", "with one constrained row"}
    assert float(rows["without"][2]) == 1.0  # the ceiling is the run without
    assert float(rows["with one constrained row"][2]) > 0
    reply = re.search(r"the constrained reply \((\d+) chars\): '(.*)'", out)
    assert reply and int(reply[1]) > 0 and reply[2].startswith("{")
