"""The overlapped step's readback (kvtier.server.batch.lookahead.TokenReadback): greedy tokens, and the
rows the host samples itself copied out in the same wait."""

from __future__ import annotations

import pytest
import torch

from kvtier.server.batch.lookahead import TokenReadback

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_kept_rows_are_the_logits_rows_as_float32(device: str) -> None:
    readback = TokenReadback(torch.device(device), max_rows=8)
    logits = torch.randn(6, 50, dtype=torch.bfloat16, device=device)
    tokens, ticket = readback.start(logits, keep=[4, 1])
    assert ticket.wait() == logits.argmax(-1).tolist()
    assert tokens.device.type == device
    assert ticket.kept is not None and ticket.kept.dtype == torch.float32
    assert ticket.kept.device.type == "cpu"  # sampled on the host, off the device's stream
    assert torch.equal(ticket.kept, logits[[4, 1]].float().cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_a_ticket_keeps_its_rows_while_the_next_step_reads_back(device: str) -> None:
    """Two buffers alternate: step N's rows stay as they were while step N+1's copy runs (the
    host completes step N after launching N+1)."""
    readback = TokenReadback(torch.device(device), max_rows=4)
    first = torch.randn(3, 20, device=device)
    _, ticket = readback.start(first, keep=[2])
    _, later = readback.start(torch.randn(3, 20, device=device), keep=[0, 1])
    later.wait()
    ticket.wait()
    assert torch.equal(ticket.kept, first[2:3].cpu())
    assert later.kept is not None and later.kept.shape == (2, 20)


def test_no_rows_kept_copies_nothing() -> None:
    readback = TokenReadback(torch.device("cpu"), max_rows=4)
    _, ticket = readback.start(torch.randn(2, 10))
    assert ticket.kept is None and len(ticket.wait()) == 2
