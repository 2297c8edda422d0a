"""The compiler check (export/toolchain.py): which libstdc++ the C++ compiler links and this process runs,
told apart with stand-in compilers; and a clean export records that there was no mismatch."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from pt2serve.export.toolchain import compiler_libstdcxx, libstdcxx_mismatch, process_libstdcxx, warn_about
from pt2serve.runtime.artifact import read_metadata


def stand_in_compiler(folder: Path, printed: str, name: str = "fake-g++") -> Path:
    """A 'compiler' that answers -print-file-name=libstdc++.so.6 with `printed` (as g++ does)."""
    path = folder / name
    path.write_text(f'#!/bin/sh\n[ "$1" = "-print-file-name=libstdc++.so.6" ] && echo "{printed}"\nexit 0\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_compiler_libstdcxx_resolves_what_the_compiler_prints(tmp_path):
    real = tmp_path / "lib" / "libstdc++.so.6.0.99"
    real.parent.mkdir()
    real.write_bytes(b"")
    link = tmp_path / "lib" / "libstdc++.so.6"
    link.symlink_to(real)
    assert compiler_libstdcxx(str(stand_in_compiler(tmp_path, str(link)))) == str(real)


def test_compiler_libstdcxx_is_none_when_the_compiler_cannot_say(tmp_path):
    # g++ prints the bare name when it has no such library; a missing compiler says nothing at all.
    assert compiler_libstdcxx(str(stand_in_compiler(tmp_path, "libstdc++.so.6"))) is None
    assert compiler_libstdcxx(str(tmp_path / "no-such-compiler")) is None


def test_process_libstdcxx_is_the_one_loaded_here():
    loaded = process_libstdcxx()
    assert loaded is not None and os.path.isfile(loaded) and "libstdc++.so" in os.path.basename(loaded)
    system = shutil.which("g++", path="/usr/bin")
    if system is None:
        pytest.skip("no system g++ to compare with")
    # torch runs with the system libstdc++ here, the one the system compiler links.
    assert compiler_libstdcxx(system) == loaded


def test_mismatch_names_the_compiler_and_both_libraries(tmp_path, monkeypatch):
    foreign = tmp_path / "opt-gcc" / "libstdc++.so.6"
    foreign.parent.mkdir()
    foreign.write_bytes(b"")
    compiler = stand_in_compiler(tmp_path, str(foreign))
    monkeypatch.setenv("CXX", str(compiler))
    message = libstdcxx_mismatch()
    assert message is not None
    assert str(compiler) in message and str(foreign) in message and process_libstdcxx() in message
    # The same compiler printing the library this process runs: no mismatch.
    monkeypatch.setenv("CXX", str(stand_in_compiler(tmp_path, process_libstdcxx(), name="good-g++")))
    assert libstdcxx_mismatch() is None


def test_the_warning_says_how_to_fix_it(capsys):
    warn_about("the C++ compiler 'x' links /a, but the exporting process ran with /b")
    err = capsys.readouterr().err
    assert err.startswith("warning: the C++ compiler 'x' links /a") and "CXX=/usr/bin/g++" in err


def test_a_clean_export_records_no_mismatch(tiny_artifact):
    """The test artifacts were exported with a compiler that links this process's libstdc++: the export
    recorded the check's result (the field is there) and it is empty."""
    assert libstdcxx_mismatch() is None
    built = read_metadata(tiny_artifact).raw["built_with"]
    assert "libstdcxx_mismatch" in built and built["libstdcxx_mismatch"] is None
