"""The cheap portability: the CPU target finds its linker as TVM does ($CC, clang, or clang on
Windows) and names what is missing in one line; checkpoint directories are not fsynced where
the OS cannot open a directory (Windows)."""
import os
import sys

import pytest

from lorac.runtime.errors import LoracError

pytest.importorskip("tvm")


def test_cpu_linker_lookup(monkeypatch, tmp_path):
    from lorac.compiler.targets.cpu import check_environment
    for var in ("CC", "CXX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler anywhere
    with pytest.raises(LoracError, match=r"needs a C compiler \(g\+\+, gcc, clang or cc on the PATH, or \$CC\)"):
        check_environment({})
    clang = tmp_path / "clang"
    clang.write_text("#!/bin/sh\n")
    clang.chmod(0o755)
    check_environment({})  # clang alone will do, as it does for TVM
    import shutil
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(shutil, "which", lambda name: str(clang) if name == "clang" else None)
    check_environment({})  # Windows: TVM links with clang
    monkeypatch.setenv("TVM_WIN_CC", "clang-cl-missing")
    with pytest.raises(LoracError, match="needs clang on the PATH"):
        check_environment({})


def test_no_directory_fsync_on_windows(monkeypatch, tmp_path):
    from lorac.runtime.train import checkpoint
    opened = []
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a) or (_ for _ in ()).throw(PermissionError(13, "dir")))
    monkeypatch.setattr(os, "name", "nt")
    checkpoint._fsync_dir(tmp_path)  # Windows refuses to open a directory: not tried at all
    assert opened == []
