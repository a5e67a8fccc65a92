"""ops: the operations toolkit of a kvtier host (collectors, exporter, kvtop, doctor).

ops may import kvtier (its snapshot types, its store for read-only views); kvtier never imports ops.
"""
