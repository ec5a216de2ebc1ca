"""Quantized frozen weights: the graph inputs a quantized [out, in] weight takes, and the ONNX
that dequantizes them to fp32 inside the graph (QLoRA: NF4, int8, GGUF blocks).

A weight `name` quantized as `q` is fed as the inputs `quant_inputs(q, name, out, in)` lists
(the runtime's frozen-weights dict holds exactly these keys, never `name` itself);
`declare(g, q, ...)` declares them and `QuantWeight.dense(g)` emits the dequantization, fresh
nodes at every call (forward, backward and recompute each dequantize; the compiler decides
what to fuse). A [V, D] table (a frozen embedding, an LM head) is read by rows instead:
`rows(g, ids, n)` gathers and dequantizes only the looked-up rows, `row_slice(g, lo, hi)` one
slice of the vocabulary (graphs/ops/loss.py reads a quantized head slice by slice); formats
whose blocks stay within a row (int8, GGUF, nf4 with whole blocks a row and a plain absmax:
`check_rows`). The layouts, and the reference each emitter equals bit for bit in float32:

  nf4   bitsandbytes' NF4 (`dequantize_4bit`). `name.nf4` uint8 [out, in/2], two codes a byte,
        the first element in the high nibble; `name.nf4_code` float32 [16] (the quant_map);
        `name.absmax` float32 [out*in/block], or with double quantization `name.absmax_q`
        uint8 [n_blocks], `name.absmax_code` float32 [256], `name.absmax_scale` float32
        [ceil(n_blocks/256)], `name.absmax_offset` float32 [1]:
        absmax = absmax_code[absmax_q] * absmax_scale[b // 256] + offset; w = code[q] * absmax[i // block]
  int8  `name.int8` int8 [out, in], `name.int8_scale` float32 [out]: w = q * scale[:, None]
  GGUF  `name.<TYPE>` uint8 [out, in/QK * block_bytes]: the file's blocks, row by row
        (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: QK 32; Q4_K, Q5_K, Q6_K: QK 256); `gguf.quants.dequantize`.
        Q5_0/Q5_1 are what llama.cpp's Q4_K_M/Q5_K_M write for a weight whose rows are not
        whole 256-value blocks (SmolLM2's hidden 576): most of such a file's projections.

Every op is a default-domain ONNX op onnxruntime and TVM's ONNX frontend both convert
(Slice, BitShift, BitwiseAnd/Or, Cast, Gather, Concat, Reshape, Expand, Mul, Add, Sub).
GGUF's fp16 scales are decoded from their two bytes with exact arithmetic: the sign and
exponent byte picks a power of two (and the implicit leading bit) from a 64-entry table,
times the integer mantissa, an exact product for every finite fp16 (subnormals included;
exponent 31, inf/NaN, decodes to +-inf). GGUF's products are exact in fp32 (an 11-bit fp16
times small integers), so fusing a multiply and add into an FMA cannot change them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from lorac.core.errors import LoracError

# (values per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES has them
GGUF_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
               "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
KINDS = ("nf4", "int8", *GGUF_BLOCKS)
NF4_BLOCKS = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # the block sizes bitsandbytes takes
NESTED = 256  # values per block of the double-quantized absmax (bitsandbytes' nested blocksize)
NF4_DOUBLE = ("absmax_q", "absmax_code", "absmax_scale", "absmax_offset")

I32, F32 = ir.DataType.INT32, ir.DataType.FLOAT


@dataclass(frozen=True)
class Quant:
    kind: str             # "nf4" | "int8" | a GGUF type name (GGUF_BLOCKS): "Q4_0" ... "Q6_K"
    block: int = 64       # nf4: elements per absmax block (bitsandbytes blocksize)
    double: bool = False  # nf4: absmax 8-bit quantized itself (bnb compress_statistics; nested block 256)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise LoracError(f"quantization {self.kind!r} is not supported (supported: {', '.join(KINDS)})")
        if self.kind == "nf4" and self.block not in NF4_BLOCKS:
            raise LoracError(f"nf4 block size {self.block} is not one of bitsandbytes' {NF4_BLOCKS}")


def check_shape(q: Quant, name: str, out: int, inp: int) -> None:
    """A LoracError naming the tensor when an [out, in] weight cannot be held as q."""
    if q.kind == "nf4":
        if (out * inp) % q.block or inp % 2:
            raise LoracError(f"tensor {name}: nf4 needs {out}x{inp} values to be whole blocks of {q.block} "
                             "and rows of an even length")
    elif q.kind in GGUF_BLOCKS and inp % GGUF_BLOCKS[q.kind][0]:
        raise LoracError(f"tensor {name}: {q.kind} needs rows of whole {GGUF_BLOCKS[q.kind][0]}-value blocks, "
                         f"not {inp}")


def nf4_blocks(q: Quant, out: int, inp: int) -> tuple[int, int]:
    """(absmax blocks, blocks of the nested absmax scale) of an nf4 weight."""
    n = out * inp // q.block
    return n, -(-n // NESTED)


def quant_inputs(q: Quant, name: str, out: int, inp: int) -> list[tuple[str, tuple[int, ...], str]]:
    """The graph inputs (name, shape, numpy dtype name) of weight `name` ([out, in]) quantized as q."""
    check_shape(q, name, out, inp)
    if q.kind == "int8":
        return [(f"{name}.int8", (out, inp), "int8"), (f"{name}.int8_scale", (out,), "float32")]
    if q.kind in GGUF_BLOCKS:
        qk, nbytes = GGUF_BLOCKS[q.kind]
        return [(f"{name}.{q.kind}", (out, inp // qk * nbytes), "uint8")]
    nb, ns = nf4_blocks(q, out, inp)
    head = [(f"{name}.nf4", (out, inp // 2), "uint8"), (f"{name}.nf4_code", (16,), "float32")]
    if not q.double:
        return head + [(f"{name}.absmax", (nb,), "float32")]
    return head + [(f"{name}.absmax_q", (nb,), "uint8"), (f"{name}.absmax_code", (256,), "float32"),
                   (f"{name}.absmax_scale", (ns,), "float32"), (f"{name}.absmax_offset", (1,), "float32")]


class QuantWeight:
    """A quantized weight's declared graph inputs; `dense(g)` is its fp32 [out, in] value."""

    def __init__(self, q: Quant, name: str, out: int, inp: int, values: dict):
        self.q, self.name, self.out, self.inp = q, name, out, inp
        self.values = values  # input suffix ("nf4", "absmax", "Q4_K", ...) -> graph value

    @property
    def shape(self) -> tuple[int, int]:
        return self.out, self.inp

    def dense(self, g):
        """Emit the dequantization (fresh nodes on every call) -> an fp32 value [out, in]
        (cast, exactly, to the graph's float type where that is float64: gradient checks)."""
        v = self.values
        if self.q.kind == "nf4":
            w = nf4_dense(g, self.q, v, self.out, self.inp)
        elif self.q.kind == "int8":
            w = g.op("Mul", g.op("Cast", v["int8"], to=F32), g.op("Unsqueeze", v["int8_scale"], g.ints(1)))
        else:
            b = blocks(g, v[self.q.kind], self.q.kind, self.out, self.inp)
            w = GGUF_EMITTERS[self.q.kind](g, b, self.out, self.inp)
        return w if g.float == F32 else g.op("Cast", w, to=g.float)

    # -- reading a table by rows (embedding lookups, the LM head's vocabulary slices) --------------
    def rows(self, g, ids, n: int):
        """The fp32 rows of the n int ids (any integer shape) -> [n, in], dequantizing only those
        rows (never the whole table): each array's rows gathered, then the same arithmetic as
        dense(), so every value equals the reference's bit for bit."""
        flat = g.reshape(ids, n)
        return self._rows(g, lambda v: g.op("Gather", v, flat, axis=0), n)

    def row_slice(self, g, lo: int, hi: int):
        """fp32 [hi - lo, in]: rows lo..hi-1 dequantized (fresh nodes on every call, as dense())."""
        return self._rows(g, lambda v: g.slice(v, lo, hi, 0), hi - lo)

    def _rows(self, g, pick, n: int):
        check_rows(self.q, self.name, self.out, self.inp)
        v = self.values
        if self.q.kind == "nf4":  # absmax as [out, in/block]: whole blocks a row
            per = self.inp // self.q.block
            codes = nf4_codes(g, pick(v["nf4"]), v)  # [n, in/2, 2]
            absmax = pick(g.reshape(v["absmax"], self.out, per))
            w = g.reshape(g.op("Mul", g.reshape(codes, n, per, self.q.block), g.op("Unsqueeze", absmax, g.ints(2))),
                          n, self.inp)
        elif self.q.kind == "int8":
            w = g.op("Mul", g.op("Cast", pick(v["int8"]), to=F32), g.op("Unsqueeze", pick(v["int8_scale"]), g.ints(1)))
        else:
            w = GGUF_EMITTERS[self.q.kind](g, blocks(g, pick(v[self.q.kind]), self.q.kind, n, self.inp), n, self.inp)
        return w if g.float == F32 else g.op("Cast", w, to=g.float)


def check_rows(q: Quant, name: str, out: int, inp: int) -> None:
    """A LoracError naming the tensor when an [out, in] table held as q cannot be read by rows
    (an embedding's lookup, an LM head's vocabulary slices): nf4 needs whole blocks in every
    row and a plain float32 absmax (a double-quantized one groups 256 blocks across rows)."""
    check_shape(q, name, out, inp)
    if q.kind == "nf4" and inp % q.block:
        raise LoracError(f"tensor {name}: nf4 rows of {inp} values are not whole {q.block}-value blocks, so the "
                         "table cannot be read by rows (an embedding lookup, an LM head's slices); int8 can")
    if q.kind == "nf4" and q.double:
        raise LoracError(f"tensor {name}: a double-quantized nf4 absmax groups blocks across rows, so the table "
                         "cannot be read by rows (an embedding lookup, an LM head's slices); use a plain absmax")


def declare(g, q: Quant, name: str, out: int, inp: int) -> QuantWeight:
    values = {}
    for key, shape, dtype in quant_inputs(q, name, out, inp):
        values[key[len(name) + 1:]] = g.input(key, list(shape), ir.DataType.from_numpy(np.dtype(dtype)))
    return QuantWeight(q, name, out, inp, values)


def detect(arrays: dict) -> dict[str, Quant]:
    """Weight name -> Quant, from the suffixed keys in `arrays` (a frozen-weights dict)."""
    found = {}
    for key in arrays:
        stem, _, suffix = key.rpartition(".")
        if suffix == "int8":
            _need(arrays, stem, ("int8_scale",))
            found[stem] = Quant("int8")
        elif suffix in GGUF_BLOCKS:
            found[stem] = Quant(suffix)
        elif suffix == "nf4":
            _need(arrays, stem, ("nf4_code",))
            double = f"{stem}.absmax_q" in arrays
            _need(arrays, stem, NF4_DOUBLE if double else ("absmax",))
            n_blocks = np.size(arrays[f"{stem}.absmax_q" if double else f"{stem}.absmax"])
            values = 2 * np.size(arrays[key])
            if not n_blocks or values % n_blocks:
                raise LoracError(f"tensor {stem}: {n_blocks} absmax blocks do not divide its {values} nf4 values")
            found[stem] = Quant("nf4", values // n_blocks, double)
    return found


def _need(arrays, stem, suffixes):
    for s in suffixes:
        if f"{stem}.{s}" not in arrays:
            raise LoracError(f"tensor {stem}: quantized, but {stem}.{s} is missing")


# ------------------------------------------------------------------ nf4

def nf4_codes(g, packed, v: dict):
    """code[b >> 4], code[b & 15] of every byte b of `packed` [..., k] -> float32 [..., k, 2] (`v`: the
    weight's inputs, code = v["nf4_code"]): each byte shifted by (4, 0) along a new last axis, its
    low nibble the index of a Gather into the 16 codes. Exact: each value is one of the 16 inputs.
    The compiler fuses the shift, the lookup and the scale after it with the bytes' read
    (compiler/passes/lookups.py): one vectorized kernel, no int32 indices or fp32 pairs in memory,
    one lookup an element after the byte's load. (A lookup into 256 code pairs needed the pairs
    first: a kernel of its own before every read, or, fused, a second dependent load an element:
    the 8B gate/up weight's read went from 73 to 92 us on the H100. A tree of 15 selects over the
    nibbles' bits fused too, but its kernels made the 8B NF4 step 195 ms slower on the H200.)"""
    shifted = _shr(g, g.op("Unsqueeze", packed, g.ints(-1)), np.array([4, 0], dtype=np.uint8))
    return g.op("Gather", v["nf4_code"], g.op("Cast", _and(g, shifted, 0x0F), to=I32))


def nf4_dense(g, q: Quant, v: dict, out: int, inp: int):
    nb, ns = nf4_blocks(q, out, inp)
    codes = nf4_codes(g, v["nf4"], v)  # [out, in/2, 2]
    if q.double:
        scale = g.op("Expand", g.op("Unsqueeze", v["absmax_scale"], g.ints(1)), g.ints(ns, NESTED))
        scale = g.reshape(scale, ns * NESTED)
        if ns * NESTED != nb:
            scale = g.slice(scale, 0, nb, 0)
        nested = g.op("Gather", v["absmax_code"], g.op("Cast", v["absmax_q"], to=I32))
        # bitsandbytes rounds the product and the sum apart (dequantize_blockwise, then += offset):
        # a clip at the lowest float between them (a max; the product unchanged: finite) keeps any
        # compiler from contracting the two into one FMA, and, unlike a kernel boundary, lets the
        # nested lookup fuse into the dequantizing kernel (four small kernels fewer a read)
        prod = g.op("Clip", g.op("Mul", nested, scale), g.const(np.float32(np.finfo(np.float32).min)))
        absmax = g.op("Add", prod, v["absmax_offset"])
    else:
        absmax = v["absmax"]
    w = g.op("Mul", g.reshape(codes, nb, q.block), g.op("Unsqueeze", absmax, g.ints(1)))
    return g.reshape(w, out, inp)


# ------------------------------------------------------------------ GGUF blocks

def blocks(g, raw, kind: str, out: int, inp: int):
    """The [out, in/QK*bytes] input as [n_blocks, bytes]."""
    qk, nbytes = GGUF_BLOCKS[kind]
    return g.reshape(raw, out * inp // qk, nbytes)


def _cols(g, b, start: int, end: int):
    return g.slice(b, start, end, 1)


def _shr(g, x, k):
    """x >> k of uint8 x; k an int or an array broadcasting against x."""
    return g.op("BitShift", x, g.const(np.asarray(k, dtype=np.uint8)), direction="RIGHT")


def _shl(g, x, k: int):
    return g.op("BitShift", x, g.const(np.uint8(k)), direction="LEFT")


def _and(g, x, mask: int):
    return g.op("BitwiseAnd", x, g.const(np.uint8(mask)))


def _float(g, x):
    return g.op("Cast", x, to=F32)


def _signed(g, x):
    """uint8 bytes read as int8, as float32 (exact: u - 256 where u >= 128)."""
    return g.op("Sub", _float(g, x), g.op("Mul", _float(g, _shr(g, x, 7)), g.const(np.float32(256))))


# fp16 from (low byte, high byte): the high byte's top six bits (sign, exponent) index the
# power of two 2^(max(e,1) - 25) with its sign, and the implicit leading bit (1024 for e > 0)
_TOP = np.arange(64)
_F16_SCALE = (np.where(_TOP >= 32, -1.0, 1.0) * np.where(_TOP % 32 == 31, np.inf, 2.0 ** (np.maximum(_TOP % 32, 1) - 25))).astype(np.float32)
_F16_LEAD = np.where(_TOP % 32 > 0, 1024.0, 0.0).astype(np.float32)


def f16(g, b, at: int):
    """The little-endian fp16 at byte `at` of every block of b [n, bytes], as float32 [n, 1]."""
    lo, hi = _cols(g, b, at, at + 1), _cols(g, b, at + 1, at + 2)
    top = g.op("Cast", _shr(g, hi, 2), to=I32)
    mant = g.op("Add", g.op("Mul", _float(g, _and(g, hi, 3)), g.const(np.float32(256))), _float(g, lo))
    mant = g.op("Add", mant, g.op("Gather", g.const(_F16_LEAD), top))
    return g.op("Mul", mant, g.op("Gather", g.const(_F16_SCALE), top))


def _nibbles(g, qs, shape):
    """Packed bytes viewed as `shape` (its axis -2 of length 1) -> low nibbles, then high ones, on axis -2."""
    x = g.reshape(qs, *shape)
    return g.op("Concat", _and(g, x, 0x0F), _shr(g, x, 4), axis=-2)


def q8_0(g, b, out, inp):
    return g.reshape(g.op("Mul", _signed(g, _cols(g, b, 2, 34)), f16(g, b, 0)), out, inp)


def q4_0(g, b, out, inp):
    q = g.op("Sub", _float(g, _nibbles(g, _cols(g, b, 2, 18), (-1, 1, 16))), g.const(np.float32(8)))
    return g.reshape(g.op("Mul", f16(g, b, 0), g.reshape(q, -1, 32)), out, inp)


def q4_1(g, b, out, inp):
    q = g.reshape(_float(g, _nibbles(g, _cols(g, b, 4, 20), (-1, 1, 16))), -1, 32)
    return g.reshape(g.op("Add", g.op("Mul", f16(g, b, 0), q), f16(g, b, 2)), out, inp)


def _fifth_bits(g, b, at: int):
    """Q5_0/Q5_1's 32 high bits, the little-endian uint32 at bytes at..at+4 of each block
    (element e's is bit e: byte e // 8, bit e % 8), as uint8 0/1 [n, 32]."""
    qh = g.reshape(_cols(g, b, at, at + 4), -1, 4, 1)
    return g.reshape(_and(g, _shr(g, qh, np.arange(8).reshape(1, 1, 8)), 0x01), -1, 32)


def _fives(g, b, at: int):
    """Q5_0/Q5_1's 5-bit quants (nibbles at at+4.., the high bits at at..at+4) as float [n, 32]."""
    low = g.reshape(_nibbles(g, _cols(g, b, at + 4, at + 20), (-1, 1, 16)), -1, 32)
    return _float(g, g.op("BitwiseOr", low, _shl(g, _fifth_bits(g, b, at), 4)))


def q5_0(g, b, out, inp):
    q = g.op("Sub", _fives(g, b, 2), g.const(np.float32(16)))
    return g.reshape(g.op("Mul", f16(g, b, 0), q), out, inp)


def q5_1(g, b, out, inp):
    return g.reshape(g.op("Add", g.op("Mul", f16(g, b, 0), _fives(g, b, 4)), f16(g, b, 2)), out, inp)


def _scale_min(g, b):
    """Q4_K/Q5_K's eight 6-bit scales and mins of each block, from its 12 bytes at 4..16."""
    d, m, md = _cols(g, b, 4, 8), _cols(g, b, 8, 12), _cols(g, b, 12, 16)
    sc = g.op("Concat", _and(g, d, 0x3F), g.op("BitwiseOr", _and(g, md, 0x0F), _and(g, _shr(g, d, 2), 0x30)), axis=1)
    mn = g.op("Concat", _and(g, m, 0x3F), g.op("BitwiseOr", _shr(g, md, 4), _and(g, _shr(g, m, 2), 0x30)), axis=1)
    return _float(g, sc), _float(g, mn)


def _kquant(g, b, q, out, inp):
    """d * sc * q - dmin * m over eight sub-blocks of 32 (q [n, 8, 32] float)."""
    sc, mn = _scale_min(g, b)
    d = g.op("Unsqueeze", g.op("Mul", f16(g, b, 0), sc), g.ints(2))
    dm = g.op("Unsqueeze", g.op("Mul", f16(g, b, 2), mn), g.ints(2))
    return g.reshape(g.op("Sub", g.op("Mul", d, q), dm), out, inp)


def q4_k(g, b, out, inp):
    q = g.reshape(_nibbles(g, _cols(g, b, 16, 144), (-1, 4, 1, 32)), -1, 8, 32)
    return _kquant(g, b, _float(g, q), out, inp)


def q5_k(g, b, out, inp):
    ql = g.reshape(_nibbles(g, _cols(g, b, 48, 176), (-1, 4, 1, 32)), -1, 8, 32)
    qh = _and(g, _shr(g, g.reshape(_cols(g, b, 16, 48), -1, 1, 32), np.arange(8).reshape(1, 8, 1)), 0x01)
    return _kquant(g, b, _float(g, g.op("BitwiseOr", ql, _shl(g, qh, 4))), out, inp)


def q6_k(g, b, out, inp):
    ql = g.reshape(_nibbles(g, _cols(g, b, 0, 128), (-1, 2, 1, 64)), -1, 8, 32)
    qh = _shr(g, g.reshape(_cols(g, b, 128, 192), -1, 2, 1, 32), np.array([0, 2, 4, 6]).reshape(1, 1, 4, 1))
    qh = g.reshape(_and(g, qh, 0x03), -1, 8, 32)
    q = g.op("Sub", _float(g, g.op("BitwiseOr", ql, _shl(g, qh, 4))), g.const(np.float32(32)))
    d = g.op("Unsqueeze", g.op("Mul", f16(g, b, 208), _signed(g, _cols(g, b, 192, 208))), g.ints(2))
    return g.reshape(g.op("Mul", d, g.reshape(q, -1, 16, 16)), out, inp)


GGUF_EMITTERS = {"Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1, "Q8_0": q8_0, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}
