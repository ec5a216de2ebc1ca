"""Dequantization of llama.cpp (GGML) tensors to float32.

Every type the `gguf` package knows (K-quants Q2_K..Q6_K, IQ*, TQ*, Q5_0/Q5_1, ...) goes
through `gguf.quants.dequantize`. Four types keep lorac's own vectorised numpy code,
because it is measured faster there (bench/bench_load.py, docs/BENCHMARKS.md "Weight
loading") and the bundled SmolLM2 file is Q4_1; the tests check both paths bit for bit.

The own types store a row as consecutive blocks of 32 values; a block is a
little-endian fp16 scale (and for Q4_1 an fp16 minimum) followed by the quants:

    Q8_0  34 bytes: d:f16, q:int8[32]                value = d * q
    Q4_0  18 bytes: d:f16, q:uint8[16] (two nibbles) value = d * (nibble - 8)
    Q4_1  20 bytes: d:f16, m:f16, q:uint8[16]        value = d * nibble + m

In a 4-bit block the low nibbles of the 16 bytes are values 0..15 and the high nibbles
values 16..31 (not interleaved), as ggml's `dequantize_row_q4_0` reads them.
The float types are plain arrays: F32, F16, and BF16 (the top half of an f32).
"""

import numpy as np

from ..errors import LoracError

# GGML type ids (ggml.h `enum ggml_type`) of the types with a path of lorac's own.
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30

BLOCK = 32  # values per block for every quantized type above
BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20}


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32: bf16 is the high 16 bits of an f32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _blocks(raw: np.ndarray, nbytes: int) -> np.ndarray:
    """Bytes of whole blocks -> a [n_blocks, nbytes] uint8 view."""
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if flat.size % nbytes:
        raise LoracError(f"quantized data of {flat.size} bytes is not whole blocks of {nbytes}")
    return flat.reshape(-1, nbytes)


def _scale(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as a float32 column [n_blocks, 1]."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes -> [n, 32] values 0..15: low nibbles first, then high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 34)
    return (_scale(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)


def dequant_q4_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 18)
    return (_scale(b, 0) * (_nibbles(b[:, 2:]) - 8.0)).reshape(-1)


def dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 20)
    return (_scale(b, 0) * _nibbles(b[:, 4:]) + _scale(b, 2)).reshape(-1)


def dequant_bf16(raw: np.ndarray) -> np.ndarray:
    return bf16_to_f32(np.asarray(raw).view(np.uint16)).reshape(-1)


# the types whose own path is faster than gguf.quants (bench/bench_load.py)
OWN = {Q8_0: dequant_q8_0, Q4_0: dequant_q4_0, Q4_1: dequant_q4_1, BF16: dequant_bf16}


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple, name: str = "tensor") -> np.ndarray:
    """Raw tensor data of `ggml_type` -> float32 array of `shape` (numpy order, rows last
    GGUF dimension first). Types neither lorac nor gguf can dequantize are refused by name."""
    t = int(ggml_type)
    if t == F32:
        out = np.asarray(raw).view(np.float32)
    elif t == F16:
        out = np.asarray(raw).view(np.float16).astype(np.float32)
    elif t in OWN:
        out = OWN[t](raw)
    else:
        out = _library(raw, t, shape, name)
    n = int(np.prod(shape))
    if out.size != n:
        raise LoracError(f"GGUF tensor {name}: {out.size} values for shape {tuple(shape)}")
    return out.reshape(shape)


def _library(raw, t: int, shape, name) -> np.ndarray:
    """gguf.quants.dequantize over rows of whole blocks."""
    import gguf
    try:
        qtype = gguf.GGMLQuantizationType(t)
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise LoracError(f"GGUF tensor {name}: unknown quantization type {t}") from None
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if shape[-1] % block or flat.size % nbytes:
        raise LoracError(f"GGUF tensor {name}: {qtype.name} data of {flat.size} bytes does not hold "
                         f"whole {block}-value blocks of rows of {shape[-1]}")
    try:
        return gguf.quants.dequantize(flat.reshape(-1, shape[-1] // block * nbytes), qtype).reshape(-1)
    except NotImplementedError:
        raise LoracError(f"GGUF tensor {name}: quantization type {qtype.name} cannot be dequantized "
                         f"(gguf {getattr(gguf, '__version__', '')} has no dequantizer for it)".replace(" ()", "")) from None

