"""Digests of llama.cpp's reference K-quant blocks for tests/test_kquants.py's inputs, and a
byte-for-byte comparison with lorac's numpy quantizers (runtime/model/quant/kquants.py).

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/l && tar xzf /tmp/l/*.tar.gz -C /tmp/l
    python scripts/kquant_reference.py /tmp/l/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml [--cflags "-march=native -std=gnu11"]

Compiles ggml-quants.c alone (stubs for the four ggml.c functions it links to but the reference
quantizers never call) with `-O2 -std=c11 -ffp-contract=off` unless --cflags says otherwise,
calls `quantize_row_q{4,5,6}_K_ref` through ctypes and prints, per input and type, the digest
and whether lorac's blocks are the same. A build that contracts a*b + c into FMAs (llama.cpp's
default: gnu11, -march=native) rounds some near ties the other way (docs/WEIGHTS.md).
"""
import argparse
import ctypes
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

STUBS = """#include <stdlib.h>
#include <stddef.h>
void ggml_abort(const char *f, int l, const char *fmt, ...) { abort(); }
size_t ggml_row_size(int t, long n) { abort(); }
const char *ggml_type_name(int t) { return "?"; }
size_t ggml_type_size(int t) { abort(); }
"""


def build(ggml: Path, cflags: str, out: Path) -> ctypes.CDLL:
    (out / "stubs.c").write_text(STUBS)
    cmd = ["gcc", "-O2", *cflags.split(), "-fPIC", "-shared", "-DNDEBUG", "-I", str(ggml / "include"), "-I",
           str(ggml / "src"), str(ggml / "src" / "ggml-quants.c"), str(out / "stubs.c"), "-lm", "-o", str(out / "q.so")]
    subprocess.run(cmd, check=True, capture_output=True)
    return ctypes.CDLL(str(out / "q.so"))


def reference(lib, x: np.ndarray, kind: str, nbytes: int) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros(x.size // 256 * nbytes, np.uint8)
    fn = getattr(lib, f"quantize_row_{kind.replace('Q', 'q')}_ref")
    fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    return out.reshape(x.shape[0], -1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("ggml", type=Path, help="llama.cpp's ggml folder (include/, src/ggml-quants.c)")
    p.add_argument("--cflags", default="-std=c11 -ffp-contract=off")
    args = p.parse_args()
    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("test_kquants", repo / "tests" / "test_kquants.py")
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    from lorac.runtime.model.quant import kquants
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(args.ggml, args.cflags, Path(tmp))
        same = True
        for case, x in tests.cases().items():
            for kind in ("Q4_K", "Q5_K", "Q6_K"):
                ref = reference(lib, x, kind, kquants.BLOCK_BYTES[kind])
                mine = kquants.quantize(x, kind)
                rows = int((ref != mine).any(axis=1).sum())
                same &= rows == 0
                print(f'("{case}", "{kind}"): "{tests.digest(ref)}",  # lorac: {"same" if not rows else f"{rows} rows differ"}')
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
