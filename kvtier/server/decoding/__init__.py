"""Decoding a row: see README.md beside this file."""

# A temperature below GREEDY_BELOW samples as greedy (vLLM's `_SAMPLING_EPS`): dividing the
# logits by less overflows them to inf, and their softmax to NaN, with nothing left to draw.
GREEDY_BELOW = 1e-5
