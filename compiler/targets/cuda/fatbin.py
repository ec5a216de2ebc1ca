"""TVM's CUDA source to a fatbin with this machine's nvcc (no GPU or driver needed): the
artifact's kernels (export) and tuning's candidates (tune.py)."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from lorac.core.errors import LoracError

DEFAULT_ARCH = "sm_90"


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/nvcc")), None)


def cuda_sources(ex) -> list[str]:
    """CUDA source of every CUDA module imported by the built library (a VM executable or
    a runtime module)."""
    import tvm
    found, stack = [], [ex if isinstance(ex, tvm.runtime.Module) else ex.mod]
    while stack:
        m = stack.pop()
        if m.kind == "cuda":
            found.append(m.inspect_source("cuda"))
        stack.extend(m.imports)
    return found


def compile_fatbin(source: str, arch: str, out: Path) -> None:
    cc = arch.removeprefix("sm_")
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "kernels.cu"
        cu.write_text(source)
        cmd = [_nvcc(), "--fatbin", "-O3", "-std=c++17",
               f"-gencode=arch=compute_{cc},code=sm_{cc}", f"-gencode=arch=compute_{cc},code=compute_{cc}",
               "-o", str(out), str(cu)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise LoracError(f"nvcc failed on TVM's CUDA kernels: {r.stderr.strip()[-600:]}")


