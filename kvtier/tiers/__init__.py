"""The storage tiers: l1 (GPU buffers), l2 (pinned host slabs), l3 (SSD chunk files)."""
