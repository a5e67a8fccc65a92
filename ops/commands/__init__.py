"""Click commands of the ops side of the `kvtier` CLI (one module per command)."""
