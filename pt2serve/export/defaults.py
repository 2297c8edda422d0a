"""Export defaults, in one place for ExportOptions and the command line (no torch import: --help stays fast)."""

DEFAULT_FORWARD_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_MAX_STEP_TOKENS = 4096
DEFAULT_MAX_CELLS = 65536
# Context cells a static (graph-captured) step may list in total; steps that see more run on forward_others.
# With the attention kernel this sizes an index buffer (8 bytes a cell), not compute; the masked attention
# path gathers every entry, so there it bounds each static step's cost too.
DEFAULT_GRAPH_ENTRIES = 65536
DEFAULT_MIN_PREFILL_CHUNK = 32
