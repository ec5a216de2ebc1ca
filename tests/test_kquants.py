"""lorac's numpy K-quant quantizers (runtime/model/quant/kquants.py) against llama.cpp's reference
quantizers: the blocks they write for fixed inputs equal, byte for byte, what ggml-quants.c's
`quantize_row_q{4,5,6}_K_ref` wrote for the same inputs (compiled with -ffp-contract=off, from
the llama.cpp inside the llama-cpp-python 0.3.36 sdist), recorded here as SHA-256 digests by
scripts/kquant_reference.py; and they dequantize (gguf.quants) close to the input."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from lorac.runtime.model.quant import kquants  # noqa: E402
from lorac.runtime.model.quant import gguf_blocks  # noqa: E402


def _uniform(n: int, seed: int) -> np.ndarray:
    """n values in [-0.5, 0.5) from an integer hash: the same float32 bits on every machine and numpy."""
    u = (np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(seed * 97 + 12345)) % np.uint64(2**32)
    u = (u * np.uint64(2246822519) + np.uint64(3266489917)) % np.uint64(2**32)
    return (u.astype(np.float64) / 2**32 - 0.5).astype(np.float32)


def cases() -> dict:
    """Inputs that reach the quantizers' branches: row scales over 20 binades, all-positive and
    all-negative rows, zero and constant sub-blocks, a zero row, outliers, tiny values."""
    x = _uniform(48 * 512, 1).reshape(48, 512)
    x *= np.float32(2.0) ** (np.arange(48) % 20 - 10).astype(np.float32)[:, None]
    x[1] = np.abs(x[1])
    x[2] = -np.abs(x[2])
    x[3] = 0
    x[4, :32] = 0.5
    x[5, 40:72] = -2
    x[6, 256:] = 0
    x[7, ::37] *= 64
    x[8] *= np.float32(1e-20)
    x[9, :16] = 0  # a Q6_K sub-block of zeros
    ints = np.round(_uniform(8 * 512, 2) * 16).astype(np.float32).reshape(8, 512)
    return {"mixed": x, "ints": ints}


# sha256 (first 16 hex digits) of ggml-quants.c's blocks for cases() (scripts/kquant_reference.py)
REFERENCE = {
    ("mixed", "Q4_K"): "da352ad3834f1fa0", ("mixed", "Q5_K"): "fd9eac39d56c3bab", ("mixed", "Q6_K"): "7be50dc4e68fa960",
    ("ints", "Q4_K"): "c2b75cbabde3bc16", ("ints", "Q5_K"): "cab2d81cbc593744", ("ints", "Q6_K"): "1a2e7c6c85f5b663",
}


def digest(blocks: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(blocks).tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("case,kind", sorted(REFERENCE))
def test_blocks_equal_ggml_reference(case, kind):
    x = cases()[case]
    blocks = kquants.quantize(x, kind)
    assert blocks.dtype == np.uint8 and blocks.shape == (x.shape[0], x.shape[1] // 256 * kquants.BLOCK_BYTES[kind])
    assert digest(blocks) == REFERENCE[case, kind]


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_dequantized_blocks_are_close(kind):
    """gguf.quants reads the blocks back within the type's step of each sub-block's range."""
    x = (_uniform(32 * 512, 3) * 2).reshape(32, 512)
    blocks = gguf_blocks.quantize(x, kind)
    back = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[kind]
    err = np.abs(back - x).reshape(-1, 32).max(axis=1)
    span = np.ptp(x.reshape(-1, 32), axis=1)
    assert back.shape == x.shape and (err <= 1.5 * span / levels).all(), (err / span).max() * levels
