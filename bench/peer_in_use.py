"""Run a torch peer script and add to each of its result lines the device memory the process
had in use after its timed steps, measured as lorac's own figure is (bench/h200_vs_peers.py):
memory in use on the device less what the process held once its CUDA context existed.

    python3 peer_in_use.py peer_fast_gpu.py llama3-8b:4x2048:unsloth-4bit-gc

torch's peak allocated (what the peer scripts report) leaves out the caching allocator's
reserve, the cuBLAS/cuDNN workspaces and the kernel images loaded into device memory, all of
which lorac's figure counts; this puts both on the same measure. So that the peer's model
building does not count against it, the allocator's cache is emptied where the script resets
its peak statistics after building (its second reset): what stays reserved after that is what
the steps themselves asked for. The in-use figure is read when the script prints its result
line, i.e. right after its timed steps, before it frees the model (the allocator never gives
memory back on its own, so that is the steps' peak).
"""
from __future__ import annotations

import gc
import json
import runpy
import sys

import torch


def used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


class _Lines:
    """stdout that adds in_use_gb to every JSON result line (one carrying step_ms)."""

    def __init__(self, out, base: int):
        self.out, self.base, self.buf = out, base, ""

    def write(self, s: str) -> int:
        self.buf += s
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            if line.startswith("{") and '"step_ms"' in line:
                row = json.loads(line)
                row["in_use_gb"] = round((used() - self.base) / 1e9, 2)
                line = json.dumps(row)
            self.out.write(line + "\n")
        return len(s)

    def flush(self) -> None:
        self.out.flush()


def main(script: str, args: list[str]) -> None:
    base = used()  # creates the context: what the process holds before the peer loads anything
    reset, calls = torch.cuda.reset_peak_memory_stats, [0]

    def reset_after_build(*a, **k):
        calls[0] += 1
        if calls[0] % 2 == 0:  # the script's second reset of a case: its model and optimizer are built
            gc.collect()
            torch.cuda.empty_cache()
        return reset(*a, **k)

    torch.cuda.reset_peak_memory_stats = reset_after_build
    sys.argv = [script, *args]
    sys.stdout = _Lines(sys.stdout, base)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stdout = sys.stdout.out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
