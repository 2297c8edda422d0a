"""Fixes to AOTInductor's code generation that exports need, applied in each process that compiles.

Undeclared `int_array_N` in the C++ wrapper: the wrapper caches each size/stride array's variable under
`id()` of the buffer the declaration was written to. Views and buffer reuses write into short-lived
buffers; once one is freed, the next buffer often gets the same id, the cache answers with the old
variable and nothing declares it in the new buffer, and the wrapper fails to compile ("'int_array_56' was
not declared in this scope"). Which export hits it depends on the kernels chosen and on memory addresses,
so a tuned 8B export failed where the same model untuned did not. Keeping every buffer the cache has seen
alive until the wrapper itself goes makes each id name one buffer, so each buffer gets its declarations.

Columns left unwritten by a C++ kernel: where a loop variable is divided by a constant (column // 128: each
column's quantization group), the C++ backend splits that loop into (range // 128) x 128 to drop the
division, without checking that 128 divides the range. A loop of 320 columns became 2 x 128: the last 64
columns of the output were never written, and the method returned whatever that memory held (an int4
export of toy-greedy, hidden size 320, groups of 128, answered mostly token 0, differently run to run).
The split is left out wherever a loop variable's range is not a multiple of its divisor.
"""

from __future__ import annotations

import functools

_applied = False


def apply() -> None:
    """Patch the code generators once per process; a torch without the patched methods is left alone."""
    global _applied
    if _applied:
        return
    _applied = True
    _declare_int_arrays_in_each_buffer()
    _split_loops_only_evenly()


def _declare_int_arrays_in_each_buffer() -> None:
    try:
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    except ImportError:
        return
    original = getattr(CppWrapperCpu, "codegen_int_array_var", None)
    if original is None:
        return

    @functools.wraps(original)
    def codegen_int_array_var(self, int_array, writeline, *args, **kwargs):
        # The cache keys on id(writeline.__self__) (or id(writeline)): hold that object as long as the cache.
        writer = getattr(writeline, "__self__", writeline)
        self.__dict__.setdefault("_int_array_writers", {})[id(writer)] = writer
        return original(self, int_array, writeline, *args, **kwargs)

    CppWrapperCpu.codegen_int_array_var = codegen_int_array_var


def _split_loops_only_evenly() -> None:
    try:
        import sympy
        from torch._inductor import ir
        from torch._inductor.codegen.cpp import CppScheduling
        from torch.utils._sympy.functions import FloorDiv
    except ImportError:
        return
    original = getattr(CppScheduling, "try_loop_split", None)
    if original is None:
        return

    def divides_unevenly(node) -> bool:
        """Whether some loop variable of the node is divided by a constant that does not divide its range."""
        if not isinstance(node.node, ir.ComputedBuffer):
            return False
        _, body, _ = node.node.get_default_sizes_body()
        divisions = [division for expr in body.indexing_exprs.values() if isinstance(expr, sympy.Expr)
                     for division in expr.find(FloorDiv)]
        # A symbolic range (a dynamic dim) counts as uneven: nothing says the divisor divides it.
        return any(dividend in body.var_ranges and divisor.is_Integer and body.var_ranges[dividend] % divisor != 0
                   for dividend, divisor in (division.args for division in divisions))

    @functools.wraps(original)
    def try_loop_split(self, nodes):
        if any(divides_unevenly(node) for node in nodes):
            return nodes
        return original(self, nodes)

    CppScheduling.try_loop_split = try_loop_split
