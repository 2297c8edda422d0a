"""The fixes pt2serve applies to AOTInductor's code generation."""

from __future__ import annotations

import functools
import itertools
import types

from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch._inductor.utils import IndentedBuffer

from pt2serve.export import inductor_fixes


def patched_wrapper() -> types.SimpleNamespace:
    """The state CppWrapperCpu's int-array methods use, with the fixes applied."""
    inductor_fixes.apply()
    wrapper = types.SimpleNamespace(codegen_int_array_var_cache={}, int_array_id=itertools.count(),
                                    declared_int_array_vars=set())
    wrapper._codegen_int_array_var_impl = functools.partial(CppWrapperCpu._codegen_int_array_var_impl, wrapper)
    return wrapper


def test_every_short_lived_buffer_declares_the_int_arrays_it_uses():
    """A buffer freed and a new one made at the same address must not share the cached variable: the new
    buffer's wrapper code would use an int_array it never declared (a C++ compile error at export)."""
    wrapper = patched_wrapper()
    for _ in range(50):
        buffer = IndentedBuffer()
        name = CppWrapperCpu.codegen_int_array_var(wrapper, "{4, 1}", buffer.writeline, known_statically=True)
        assert f"{name}[] = {{4, 1}};" in buffer.getvalue()
        del buffer  # the next buffer may get this one's address


def test_one_buffer_declares_each_array_once():
    wrapper = patched_wrapper()
    buffer = IndentedBuffer()
    names = {CppWrapperCpu.codegen_int_array_var(wrapper, "{4, 1}", buffer.writeline) for _ in range(3)}
    assert len(names) == 1 and buffer.getvalue().count("= {4, 1};") == 1
