"""Export defaults, in one place for ExportOptions and the command line (no torch import: --help stays fast)."""

DEFAULT_FORWARD_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_MAX_STEP_TOKENS = 4096
# An upper bound only: the runtime sizes the pool by memory. Cells are int64 ids and the pool's element
# offsets (cell x kv heads x head dim) are int64 too; 2^40 cells keeps those offsets in range for any model
# with fewer than 2^23 K/V values per cell, so no pool a machine can hold is capped at export.
DEFAULT_MAX_CELLS = 2**40
# Context cells a static DFlash draft method lists at most (--draft), and a static forward of an artifact
# with masked attention (which gathers every entry: there it bounds each static step's cost). With the
# attention kernel a static forward holds every entry its width can meet (ExportOptions.entries_for).
DEFAULT_GRAPH_ENTRIES = 65536
DEFAULT_MIN_PREFILL_CHUNK = 32
# Sequences per static DFlash draft method (--draft-sizes): a step drafts its speculating sequences in calls
# of the narrowest size that holds them.
DEFAULT_DRAFT_SIZES = (1, 2, 4, 8)
