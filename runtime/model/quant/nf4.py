"""NF4 (4-bit NormalFloat) as bitsandbytes stores it: the reference quantizer and dequantizer
in numpy, and the reading of pre-quantized `*-bnb-4bit` checkpoints.

Layout (lorac.graphs.ops.quant): `name.nf4` uint8 [out, in/2] (element 2k in the high nibble of
byte k, as bnb packs the flattened weight), `name.nf4_code` float32 [16], and `name.absmax`
float32 [n_blocks], or, double-quantized, `name.absmax_q` uint8 [n_blocks] with
`name.absmax_code` [256], `name.absmax_scale` [ceil(n_blocks/256)], `name.absmax_offset` [1].

The quantizer follows bnb's CUDA kernel as written (csrc/kernels.cu kQuantizeBlockwise, what
`*-bnb-4bit` checkpoints were made with): per block absmax = max|w|; x = w * (1/absmax) (a
float32 reciprocal, then a product); the NF4 code is the nearest of the 16 (ties to the lower;
the float32 midpoints are exactly the kernel's thresholds); double quantization subtracts
offset = mean(absmax) and quantizes each 256-block of that to the nearest of bnb's signed
dynamic 8-bit map the same way. Checked bit for bit against bitsandbytes 0.50.2 on the CPU:
`quantize_4bit`'s codes and absmax, its torch `quantize_blockwise` for the nested state, and
`dequantize_4bit` (tests/test_quant_bnb.py; its gpu test does the same against CUDA). Known
differences inside bnb itself: its CPU library rounds the nested absmax through a
65536-entry table (measured: 0.15% of nested codes one step off nearest); `offset` is
torch's float32 mean, whose summation order differs by device (lorac's is the correctly
rounded mean); its CPU `dequantize_4bit` is wrong for rows shorter than a block.
"""
from __future__ import annotations

import json

import numpy as np

from lorac.core.errors import LoracError
from lorac.graphs.ops.quant import NESTED, Quant, check_shape

# bitsandbytes' NF4 code (functional.get_4bit_type("nf4")): float32 of its float64 table
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], dtype=np.float32)


def dynamic_map() -> np.ndarray:
    """bnb's `create_dynamic_map(signed=True)`: 256 sorted float32 values in [-1, 1], with
    torch's float32 linspace and float32 products, as bnb computes them."""
    data = [0.0, 1.0]
    for i in range(7):
        bounds = _linspace(0.1, 1.0, 2 ** i + 1)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        scaled = np.float32(10 ** (-6 + i)) * means
        data += scaled.tolist() + (-scaled).tolist()
    return np.array(sorted(data), dtype=np.float32)


def _linspace(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace(start, end, steps, dtype=float32): a float32 step, each point a fused
    multiply-add (exact in float64 here, then rounded), the first half counting up from
    start, the rest down from end (checked against torch for bnb's step counts)."""
    start, end = np.float32(start), np.float32(end)
    step = np.float64((end - start) / np.float32(steps - 1))
    i = np.arange(steps, dtype=np.float64)
    return np.where(i < steps // 2, np.float64(start) + step * i, np.float64(end) - step * (steps - 1 - i)).astype(np.float32)


def _nearest(x: np.ndarray, code: np.ndarray) -> np.ndarray:
    """Index of the nearest code value (code sorted; a tie goes to the lower): the number of
    midpoints below x. Counted by comparisons for a 16-value code (5x faster than searchsorted)."""
    mid = ((code[:-1] + code[1:]) / np.float32(2)).astype(np.float32)
    if mid.size > 15:
        return np.searchsorted(mid, x, side="left").astype(np.uint8)
    q = np.zeros(x.shape, np.uint8)
    above = np.empty(x.shape, bool)
    for m in mid:
        q += np.greater(x, m, out=above)
    return q


CHUNK = 4096  # blocks quantized at a time: the passes over a chunk stay in the cache (~10x faster)


def _blockwise(x: np.ndarray, block: int, code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, absmax) of x (1-D float32) in blocks of `block`, the last one possibly short
    (zero-padded: its absmax is that of its own values)."""
    n = x.size
    nb = -(-n // block)
    if nb * block != n:
        x = np.concatenate([x, np.zeros(nb * block - n, np.float32)])
    blocks = x.reshape(nb, block)
    q = np.empty(nb * block, np.uint8)
    absmax = np.empty(nb, np.float32)
    for i in range(0, nb, CHUNK):
        b = blocks[i:i + CHUNK]
        absmax[i:i + CHUNK] = am = np.abs(b).max(axis=1)
        inv = np.float32(1) / np.maximum(am, np.float32(1e-38))
        scaled = np.clip(b * inv[:, None], -1, 1).reshape(-1)
        q[i * block:i * block + scaled.size] = _nearest(scaled, code)
    return q[:n], absmax


def double_quantize(absmax: np.ndarray, offset=None) -> dict:
    """The nested state of a float32 absmax: codes, code map, per-256 scales and the offset
    (default the mean of absmax, correctly rounded to float32)."""
    absmax = np.asarray(absmax, np.float32)
    if offset is None:
        offset = absmax.mean(dtype=np.float64)
    offset = np.float32(offset)
    code = dynamic_map()
    q, scale = _blockwise(absmax - offset, NESTED, code)
    return {"absmax_q": q, "absmax_code": code, "absmax_scale": scale,
            "absmax_offset": np.array([offset], np.float32)}


def quantize(w, block: int = 64, double: bool = True, name: str = "weight") -> dict:
    """A dense [out, in] weight (float32, bf16 or fp16) -> its arrays, keys relative to the
    weight's name ("nf4", "nf4_code", "absmax" or the four double-quantized ones)."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise LoracError(f"tensor {name}: nf4 quantizes 2-D weights, not shape {w.shape}")
    check_shape(Quant("nf4", block, double), name, *w.shape)
    x = w.astype(np.float32).reshape(-1)
    if not np.isfinite(x).all():
        raise LoracError(f"tensor {name}: has non-finite values; cannot quantize it")
    q, absmax = _blockwise(x, block, NF4_CODE)
    out = {"nf4": ((q[0::2] << 4) | q[1::2]).reshape(w.shape[0], w.shape[1] // 2), "nf4_code": NF4_CODE.copy()}
    return {**out, **(double_quantize(absmax) if double else {"absmax": absmax})}


def absmax_of(arrays: dict, prefix: str = "") -> np.ndarray:
    """The float32 absmax of an nf4 weight's arrays (`prefix` + suffix keys), as bnb forms it."""
    if prefix + "absmax" in arrays:
        return np.asarray(arrays[prefix + "absmax"], np.float32)
    q = np.asarray(arrays[prefix + "absmax_q"])
    code = np.asarray(arrays[prefix + "absmax_code"], np.float32)
    scale = np.repeat(np.asarray(arrays[prefix + "absmax_scale"], np.float32), NESTED)[:q.size]
    return code[q] * scale + np.asarray(arrays[prefix + "absmax_offset"], np.float32)[0]


def dequantize(arrays: dict, out: int, inp: int, prefix: str = "") -> np.ndarray:
    """float32 [out, in], as bnb's dequantize_4bit: code[q] * absmax[i // block]."""
    packed = np.asarray(arrays[prefix + "nf4"]).reshape(-1)
    code = np.asarray(arrays[prefix + "nf4_code"], np.float32)
    absmax = absmax_of(arrays, prefix)
    if packed.size * 2 != out * inp or (out * inp) % absmax.size:
        raise LoracError(f"tensor {prefix.rstrip('.') or 'nf4'}: {packed.size} bytes and {absmax.size} blocks "
                         f"do not hold a {out}x{inp} weight")
    q = np.stack([packed >> 4, packed & 0x0F], axis=1).reshape(absmax.size, -1)
    return (code[q] * absmax[:, None]).reshape(out, inp)


# ------------------------------------------------------------------ pre-quantized checkpoints

BNB_STATE = "quant_state.bitsandbytes__"


def bnb_state(tensors: dict, name: str) -> dict:
    """The JSON quant state bnb packs into `name.quant_state.bitsandbytes__<type>` (uint8)."""
    keys = [k for k in tensors if k.startswith(f"{name}.{BNB_STATE}")]
    if len(keys) != 1:
        raise LoracError(f"tensor {name}: expected one {name}.{BNB_STATE}nf4 tensor, found {len(keys)}")
    qtype = keys[0].rsplit("__", 1)[1]
    if qtype != "nf4":
        raise LoracError(f"tensor {name}: bitsandbytes quant type {qtype!r} is not supported (only nf4)")
    try:
        state = json.loads(np.asarray(tensors[keys[0]], np.uint8).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise LoracError(f"tensor {keys[0]}: not a bitsandbytes quant state (bad JSON)") from None
    if not isinstance(state, dict) or state.get("quant_type") != "nf4":
        raise LoracError(f"tensor {name}: bitsandbytes quant_type {state.get('quant_type') if isinstance(state, dict) else None!r} "
                         "is not supported (only nf4)")
    return state


def from_bnb(tensors: dict, name: str) -> tuple[dict, tuple[int, int]]:
    """A `*-bnb-4bit` checkpoint's tensors of weight `name` (`name` uint8 [n, 1], `name.absmax`,
    `name.quant_map`, `name.nested_absmax`, `name.nested_quant_map`,
    `name.quant_state.bitsandbytes__nf4`) -> (arrays keyed by suffix, (out, in))."""
    state = bnb_state(tensors, name)
    shape, block = state.get("shape"), state.get("blocksize")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) and s > 0 for s in shape)):
        raise LoracError(f"tensor {name}: bitsandbytes shape {shape!r} is not a 2-D weight shape")
    out, inp = shape
    try:
        check_shape(Quant("nf4", block), name, out, inp)
    except (LoracError, TypeError) as e:
        raise LoracError(f"tensor {name}: bitsandbytes blocksize {block!r} does not fit shape {shape} ({e})") from None
    nb = out * inp // block
    packed = _get(tensors, name, "", np.uint8, out * inp // 2)
    arrays = {"nf4": packed.reshape(out, inp // 2), "nf4_code": _get(tensors, name, ".quant_map", np.float32, 16)}
    if f"{name}.nested_absmax" in tensors:
        if state.get("nested_blocksize") != NESTED:
            raise LoracError(f"tensor {name}: nested_blocksize {state.get('nested_blocksize')!r} is not supported (only {NESTED})")
        try:
            offset = np.float32(float(state["nested_offset"]))
        except (KeyError, TypeError, ValueError):
            raise LoracError(f"tensor {name}: bitsandbytes quant state has no numeric nested_offset") from None
        arrays.update(absmax_q=_get(tensors, name, ".absmax", np.uint8, nb),
                      absmax_code=_get(tensors, name, ".nested_quant_map", np.float32, 256),
                      absmax_scale=_get(tensors, name, ".nested_absmax", np.float32, -(-nb // NESTED)),
                      absmax_offset=np.array([offset], np.float32))
        check_absmax(name, arrays["absmax_scale"], "nested_absmax")
        if not np.isfinite(offset):
            raise LoracError(f"tensor {name}: nested_offset is not finite")
    else:
        arrays["absmax"] = _get(tensors, name, ".absmax", np.float32, nb)
        check_absmax(name, arrays["absmax"], "absmax")
    if not np.isfinite(arrays["nf4_code"]).all() or not np.isfinite(arrays.get("absmax_code", 0)).all():
        raise LoracError(f"tensor {name}: its quant_map holds non-finite values")
    return arrays, (out, inp)


def check_absmax(name: str, absmax: np.ndarray, what: str = "absmax") -> None:
    bad = ~(np.isfinite(absmax) & (absmax >= 0))
    if bad.any():
        i = int(np.argmax(bad))
        raise LoracError(f"tensor {name}: corrupt {what} (block {i} holds {absmax[i]!r}: non-finite or negative)")


def _get(tensors, name, suffix, dtype, size):
    key = name + suffix
    if key not in tensors:
        raise LoracError(f"tensor {name}: bitsandbytes tensor {key} is missing")
    x = np.asarray(tensors[key])
    if x.size != size or (np.dtype(dtype) == np.uint8 and x.dtype != np.uint8):
        raise LoracError(f"tensor {key}: {x.dtype} of {x.size} values where {np.dtype(dtype).name} of {size} "
                         "are expected (a block count that does not divide?)")
    return np.ascontiguousarray(x.reshape(-1), dtype=dtype)
