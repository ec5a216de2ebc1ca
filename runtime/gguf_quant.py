"""Dequantization of llama.cpp (GGML) tensor blocks to float32, vectorised in numpy.

Every quantized type stores a row as consecutive blocks of 32 values; a block is a
little-endian fp16 scale (and for Q4_1 an fp16 minimum) followed by the quants:

    Q8_0  34 bytes: d:f16, q:int8[32]                value = d * q
    Q4_0  18 bytes: d:f16, q:uint8[16] (two nibbles) value = d * (nibble - 8)
    Q4_1  20 bytes: d:f16, m:f16, q:uint8[16]        value = d * nibble + m

In a 4-bit block the low nibbles of the 16 bytes are values 0..15 and the high nibbles
values 16..31 (not interleaved), as ggml's `dequantize_row_q4_0` reads them.
The float types are plain arrays: F32, F16, and BF16 (the top half of an f32).
"""

import numpy as np

from .errors import LoracError

# GGML type ids (ggml.h `enum ggml_type`); only the ones lorac reads are named.
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30

BLOCK = 32  # values per block for every quantized type above
BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20}
TYPE_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1"}


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


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple, name: str = "tensor") -> np.ndarray:
    """Raw tensor data of `ggml_type` -> float32 array of `shape` (numpy order, rows last
    GGUF dimension first). Unsupported types are refused with their name."""
    t = int(ggml_type)
    if t == F32:
        out = np.asarray(raw).view(np.float32)
    elif t == F16:
        out = np.asarray(raw).view(np.float16).astype(np.float32)
    elif t == BF16:
        out = bf16_to_f32(np.asarray(raw).view(np.uint16))
    elif t == Q8_0:
        out = dequant_q8_0(raw)
    elif t == Q4_0:
        out = dequant_q4_0(raw)
    elif t == Q4_1:
        out = dequant_q4_1(raw)
    else:
        raise LoracError(f"GGUF tensor {name}: quantization type {type_name(t)} is not supported "
                         f"(supported: {', '.join(TYPE_NAMES.values())})")
    n = int(np.prod(shape))
    if out.size != n:
        raise LoracError(f"GGUF tensor {name}: {out.size} values for shape {tuple(shape)}")
    return out.reshape(shape)


def type_name(ggml_type: int) -> str:
    """A GGML type id -> its llama.cpp name (Q4_K, IQ2_XS, ...), for error messages."""
    if ggml_type in TYPE_NAMES:
        return TYPE_NAMES[ggml_type]
    try:  # gguf knows every type's name; the dequantizer itself does not rely on it
        import gguf
        return gguf.GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type {ggml_type}"
