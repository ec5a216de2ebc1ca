"""Choices a device times once per GEMM shape on this machine and keeps: in memory, and once an
artifact cache is known (`set_file`) in a JSON file of its .lorac-tuning folder,
{"<section>": {shape key: value}}. The section names what the timing depends on (libraries
and their versions, threads, the GPU), so a run with other libraries or another GPU keeps its
own choices beside the others. Used by the CPU's BLAS choice (cpu/choice.py: cpu-gemm.json)
and cuBLAS's algorithm choice (cuda/cublas.py: cuda-gemm.json).
"""
from __future__ import annotations

import json
from pathlib import Path

from lorac.core import atomic


class Choices:
    """`encode(value) -> str` writes a value to the file; `decode(str) -> value or None` reads
    one back (None: not ours or stale, timed anew)."""

    def __init__(self, filename: str, encode=str, decode=lambda s: s):
        self.filename, self.encode, self.decode = filename, encode, decode
        self.section = ""
        self.values: dict = {}
        self.timed: set[str] = set()  # the keys whose value was timed (or read): the ones the file keeps
        self.file: Path | None = None

    def configure(self, section: str) -> None:
        self.section = section
        self.values.clear()
        self.timed.clear()

    def set_file(self, folder) -> None:
        """Read and from now on write `folder`/filename."""
        path = Path(folder) / self.filename
        if path == self.file:
            return
        self.file = path
        for key, text in _read(path).get(self.section, {}).items():
            value = self.decode(str(text))
            if value is not None:
                self.values.setdefault(key, value)
                self.timed.add(key)

    def get(self, key: str):
        return self.values.get(key)

    def remember(self, key: str, value):
        """A value kept in memory only (not timed, not written)."""
        self.values[key] = value
        return value

    def keep(self, key: str, value):
        """A timed value: kept, and written to the file."""
        self.values[key] = value
        self.timed.add(key)
        if self.file is not None:
            data = _read(self.file)
            data[self.section] = {k: self.encode(v) for k, v in sorted(self.values.items()) if k in self.timed}
            try:
                self.file.parent.mkdir(parents=True, exist_ok=True)
                atomic.write_text(self.file, json.dumps(data, indent=1) + "\n")
            except OSError:
                pass  # a read-only cache: the choices stay in this process
        return value


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}
