"""Fixes to AOTInductor's code generation that exports need, applied in each process that compiles.

Undeclared `int_array_N` in the C++ wrapper: the wrapper caches each size/stride array's variable under
`id()` of the buffer the declaration was written to. Views and buffer reuses write into short-lived
buffers; once one is freed, the next buffer often gets the same id, the cache answers with the old
variable and nothing declares it in the new buffer, and the wrapper fails to compile ("'int_array_56' was
not declared in this scope"). Which export hits it depends on the kernels chosen and on memory addresses,
so a tuned 8B export failed where the same model untuned did not. Keeping every buffer the cache has seen
alive until the wrapper itself goes makes each id name one buffer, so each buffer gets its declarations.
"""

from __future__ import annotations

import functools

_applied = False


def apply() -> None:
    """Patch the wrapper generator once per process; a torch without the cache is left alone."""
    global _applied
    if _applied:
        return
    _applied = True
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
