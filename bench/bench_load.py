"""Weight loading: lorac's own GGUF dequantizers vs `gguf.quants.dequantize`, and safetensors
tensors as views of the mapped file (weights.load_safetensors) vs the library's
`safe_open(...).get_tensor` copies.

Usage: python bench/bench_load.py [--safetensors-mb 614]
Prints JSON lines: ms per GGUF type at the SmolLM2 embedding's size (49152 x 576), best of 3;
then seconds and peak RSS to read every value of an fp32 safetensors file, each way in a
fresh process, page cache warm.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from lorac.runtime.model.gguf_quant import OWN

ROWS, COLS = 49152, 576
READ = """
import sys, time, numpy as np
path, way = sys.argv[1:3]
t0 = time.perf_counter()
if way == "mapped":
    from lorac.runtime.model.weights import load_safetensors
    w = load_safetensors(path)
else:
    from safetensors import safe_open
    with safe_open(path, framework="numpy") as f:
        w = {k: f.get_tensor(k) for k in f.keys()}
total = sum(float(v.sum()) for v in w.values())
dt = time.perf_counter() - t0
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) // 1024
print(dt, peak)
"""


def best(fn, n=3):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(min(times) * 1e3, 1)


def gguf_types():
    x = (0.05 * np.random.default_rng(0).standard_normal((ROWS, COLS))).astype(np.float32)
    for qtype in sorted(OWN):
        qt = gguf.GGMLQuantizationType(qtype)
        q = gguf.quants.quantize(x, qt)
        raw = q.reshape(-1).view(np.uint8)
        library = lambda: gguf.quants.dequantize(q, qt)  # noqa: E731
        assert np.array_equal(OWN[qtype](raw).reshape(ROWS, COLS), library().reshape(ROWS, COLS))
        print(json.dumps(dict(type=qt.name, values=ROWS * COLS, own_ms=best(lambda: OWN[qtype](raw)),
                              gguf_quants_ms=best(library))))


def safetensors_read(mb: int):
    from safetensors.numpy import save_file
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "w.safetensors")
        rng = np.random.default_rng(0)
        n = max(1, mb * 2**20 // (576 * 1536 * 4))
        save_file({f"layer{i}.w": rng.standard_normal((576, 1536), dtype=np.float32) for i in range(n)}, path)
        for way in ("mapped", "library", "mapped", "library"):
            out = subprocess.run([sys.executable, "-c", READ, path, way], capture_output=True, text=True, check=True)
            s, peak = out.stdout.split()
            print(json.dumps(dict(safetensors=way, tensor_mb=round(n * 576 * 1536 * 4 / 2**20), s=round(float(s), 2),
                                  peak_rss_mb=int(peak))))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--safetensors-mb", type=int, default=614)
    args = ap.parse_args()
    gguf_types()
    safetensors_read(args.safetensors_mb)
