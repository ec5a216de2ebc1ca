"""Frozen base weights: an HF model directory (config.json + safetensors, one file or
sharded) or a llama.cpp GGUF file -> (config dict, {HF name: numpy array}).

The `safetensors` library checks each file (header length and JSON, known dtypes, offsets
inside the file that match the shapes, no overlap, no gap); every fault becomes one line.
The tensors are then read as views of the memory-mapped file at the offsets of the header
(u64 little-endian length N, N bytes of JSON {name: {dtype, shape, data_offsets}}, then
the data) rather than through `safe_open(...).get_tensor`, which copies each tensor out of
the file: measured on a 614 MB fp32 file, the library's copy took 1.6 s and a peak RSS of
1256 MB, the mapped views 0.19 s and 641 MB of page cache the kernel can drop
(bench/bench_load.py, docs/BENCHMARKS.md "Weight loading"). A float32 tensor asked for as
float32 stays a read-only view, so a large model costs page cache, not heap.
"""

import json
import os
import struct
from typing import NamedTuple

import numpy as np

from lorac.core.dtypes import as_dtype  # noqa: F401 (callers import it from here too)

from ..errors import LoracError
from ..files import check_regular, open_regular
from .checks import check_weights, required_tensors  # noqa: F401 (callers import them from here too)

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bfloat16",
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


def convert(raw: np.ndarray, src: str, dtype) -> np.ndarray:
    """A tensor in safetensors dtype `src` -> dtype; no copy when they already agree."""
    dtype = as_dtype(dtype)
    if src == "BF16":
        if dtype.name == "bfloat16":
            return raw.view(dtype)
        # bf16 is the high half of an f32: widen the bits, no rounding involved
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(dtype, copy=False)
    return raw if raw.dtype == dtype else raw.astype(dtype)


def read_safetensors_header(path) -> tuple[dict, int]:
    """(header dict without __metadata__, byte offset of the data) of a file the safetensors
    library accepts, or a LoracError."""
    from safetensors import SafetensorError, safe_open

    if os.path.isdir(path):
        raise LoracError(f"{path}: is a directory, not a safetensors file")
    if not os.path.exists(path):
        raise LoracError(f"weights file not found: {path}")
    check_regular(path, "safetensors file")  # a FIFO would block the library's open for ever
    try:
        with safe_open(os.fspath(path), framework="numpy"):
            pass
    except SafetensorError as e:
        reason = (str(e).splitlines() or ["unreadable"])[0].removeprefix("Error while deserializing header: ")
        raise LoracError(f"{path}: corrupt safetensors file ({reason})") from None
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    for name, e in header.items():
        if e["dtype"] not in SAFETENSORS_DTYPES:
            raise LoracError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
    return header, 8 + n


def load_safetensors(path, dtype=np.float32, names=None) -> dict:
    """{name: array} from one safetensors file, memory-mapped; `names` picks a subset.
    Integer tensors are returned as stored; float tensors are converted to dtype."""
    header, start = read_safetensors_header(path)
    if not header:
        return {}
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name in header if names is None else names:
        if name not in header:
            raise LoracError(f"{path}: tensor {name} is missing")
        e = header[name]
        begin, end = e["data_offsets"]
        src = e["dtype"]
        store = np.uint16 if src == "BF16" else SAFETENSORS_DTYPES[src]
        raw = mm[start + begin:start + end].view(store).reshape(e["shape"])
        is_float = src in ("F64", "F32", "F16", "BF16")
        out[name] = convert(raw, src, dtype) if is_float else raw
    return out


def read_config(model_dir) -> dict:
    path = os.path.join(model_dir, "config.json")
    try:
        with open_regular(path, what="config.json") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoracError(f"{model_dir}: no config.json (not an HF model directory)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoracError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise LoracError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise LoracError(f"{path}: has no model_type")
    return config


def load_hf_dir(model_dir, dtype=np.float32, quantize=None, keep_quantized=False) -> tuple[dict, dict]:
    """(config.json dict, {HF name: array}) from an HF model directory.

    A bitsandbytes 4-bit NF4 checkpoint (config.json quantization_config) has its quantized
    weights dequantized to dtype through the reference (quant/nf4.py), or with keep_quantized
    its LoRA targets' weights kept as nf4 arrays (lorac.graphs.ops.quant layout). quantize="nf4" or
    "int8" quantizes the targets' dense weights on load (quant.quantize_targets)."""
    from .quant import quantize_targets
    from .quant import bnb_dir
    if not os.path.isdir(model_dir):
        raise LoracError(f"model directory not found: {model_dir}")
    config = read_config(model_dir)
    shards = _shards(model_dir)
    if bnb_dir.is_bnb(config, model_dir):
        weights = _load_bnb(shards, config, dtype, keep_quantized, model_dir)
    else:
        weights = {}
        for path, names in shards.items():
            weights.update(load_safetensors(path, dtype, names))
    check_weights(config, weights, model_dir)
    return config, quantize_targets(config, weights, quantize)


def _shards(model_dir) -> dict:
    """{safetensors file: the tensor names to read from it, None for all} of an HF directory."""
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, INDEX)
    if os.path.exists(single):
        return {single: None}
    if not os.path.exists(index):
        raise LoracError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    shards = {}
    for name, shard in read_index(model_dir).items():
        shards.setdefault(shard, []).append(name)
    out = {}
    for shard, names in sorted(shards.items()):
        path = os.path.join(model_dir, shard)
        if not os.path.exists(path):
            raise LoracError(f"{index}: shard {shard} is missing")
        out[path] = names
    return out


INDEX = "model.safetensors.index.json"


def read_index(model_dir) -> dict:
    """{tensor name: shard file} of a sharded HF model (model.safetensors.index.json). Each shard
    must be a relative path inside the model folder: an absolute path or one climbing out with
    `..` would make lorac read (and a merged export write) files the user never named."""
    index = os.path.join(model_dir, INDEX)
    try:
        with open_regular(index, what="safetensors index") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise LoracError(f"{index}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise LoracError(f"{index}: not a safetensors index (not valid JSON)") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise LoracError(f"{index}: not a safetensors index (weight_map must be an object of tensor names and "
                         f"shard files, got {type(weight_map).__name__})")
    bad = next((f"{k!r}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str)), None)
    if bad:
        raise LoracError(f"{index}: weight_map entry {bad[:200]} does not name a shard file")
    for shard in sorted(set(weight_map.values())):
        if not shard_inside(shard):
            raise LoracError(f"{index}: shard {shard!r} lies outside the model folder (an absolute path or `..`); "
                             "shards must be files of the model folder")
    return weight_map


def shard_inside(name: str) -> bool:
    """Whether a shard name is a plain relative path that stays inside its folder."""
    parts = name.replace("\\", "/").split("/")
    return bool(name) and not os.path.isabs(name) and not name.startswith(("/", "\\")) and ":" not in parts[0] \
        and ".." not in parts and all(parts)


def _load_bnb(shards: dict, config: dict, dtype, keep_quantized: bool, source) -> dict:
    """A bitsandbytes 4-bit checkpoint's tensors: quantization state read as float32, the rest
    in dtype; then each quantized weight kept as nf4 arrays (the LoRA targets, when asked) or
    dequantized (quant/bnb_dir.py)."""
    from .quant import target_names
    from .quant import bnb_dir
    shards = {path: list(read_safetensors_header(path)[0]) if names is None else names for path, names in shards.items()}
    state = bnb_dir.float32_names([n for names in shards.values() for n in names])  # a weight's state may span shards
    tensors = {}
    for path, names in shards.items():
        tensors.update(load_safetensors(path, np.float32, [n for n in names if n in state]))
        tensors.update(load_safetensors(path, dtype, [n for n in names if n not in state]))
    keep = set(target_names(config)) if keep_quantized else set()
    return bnb_dir.convert(tensors, dtype, keep, source)


def weight_files(path) -> list:
    """The files holding a model's weights: a .gguf file, or an HF directory's safetensors."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    return [os.path.join(path, s) for s in sorted(set(read_index(path).values()))]


FINGERPRINT_WINDOWS, FINGERPRINT_BYTES = 17, 1 << 16


def fingerprint(path) -> str:
    """Identity of a model's weights without reading them all: per weight file its size, its
    first MiB (the header) and 17 windows of 64 KiB spread evenly over it. Two models of one
    config (a base and its fine-tune) differ in every window, so they never share it."""
    import hashlib
    h = hashlib.sha256()
    for file in weight_files(path):
        size = os.path.getsize(file)
        h.update(f"{os.path.basename(file)}:{size}\n".encode())
        with open(file, "rb") as f:
            h.update(f.read(1 << 20))
            for k in range(FINGERPRINT_WINDOWS):
                f.seek(max(0, (size - FINGERPRINT_BYTES) * k // (FINGERPRINT_WINDOWS - 1)))
                h.update(f.read(FINGERPRINT_BYTES))
    return h.hexdigest()


def model_config(path) -> dict:
    """The config dict of an HF model directory or a .gguf file, without reading weights."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from .gguf import gguf_config, open_gguf
        return gguf_config(open_gguf(path), path)
    return read_config(path)


def load_model(path, dtype=np.float32, quantize=None, keep_quantized=False) -> tuple[dict, dict]:
    """(config dict, weights) from an HF model directory or a .gguf file. keep_quantized keeps
    the LoRA targets' weights that the file holds quantized (bitsandbytes NF4, GGUF Q4_0..Q6_K)
    as they are; quantize ("nf4", "int8") quantizes the targets' dense weights (runtime/model/quant)."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from .gguf import load_gguf
        return load_gguf(path, dtype, quantize=quantize, keep_quantized=keep_quantized)
    if os.path.isfile(path):
        raise LoracError(f"{path}: expected an HF model directory or a .gguf file")
    if not os.path.isdir(path):
        check_regular(path, "model")  # a FIFO or device: refused by what it is
    return load_hf_dir(path, dtype, quantize=quantize, keep_quantized=keep_quantized)


class TensorInfo(NamedTuple):
    """A tensor as load_model would return it, without its data: dtype, size, nbytes."""
    dtype: np.dtype
    size: int
    nbytes: int


def tensor_infos(path, dtype=np.float32) -> dict:
    """{name: TensorInfo} of what load_model(path, dtype) returns for a base held dense (float
    tensors converted to dtype, integer ones as stored), from the safetensors headers or the
    GGUF tensor infos: no tensor is read (`--compile-only` sizes its step from these)."""
    path, dtype = os.fspath(path), as_dtype(dtype)
    info = lambda dt, n: TensorInfo(dt, n, n * dt.itemsize)  # noqa: E731
    if path.endswith(".gguf") and os.path.exists(path):  # open_gguf refuses a FIFO in one line
        from .gguf import architecture, hf_name, metadata, open_gguf
        reader = open_gguf(path)
        _, family = architecture(metadata(reader), path)
        return {hf_name(t.name, family): info(dtype, int(t.n_elements)) for t in reader.tensors}
    if os.path.isfile(path):
        raise LoracError(f"{path}: expected an HF model directory or a .gguf file")
    if not os.path.isdir(path):
        raise LoracError(f"model directory not found: {path}")
    out = {}
    for file, names in _shards(path).items():
        header = read_safetensors_header(file)[0]
        for name in header if names is None else names:
            if name not in header:
                raise LoracError(f"{file}: tensor {name} is missing")
            stored = header[name]["dtype"]
            dt = dtype if stored in ("F64", "F32", "F16", "BF16") else np.dtype(SAFETENSORS_DTYPES[stored])
            out[name] = info(dt, int(np.prod(header[name]["shape"], dtype=np.int64)))
    return out


def frozen_sizes_of(path) -> tuple[int, int]:
    """train/memory.frozen_sizes of the weights load_model(path) returns for a base held
    dense, from headers alone."""
    from ..train.memory import frozen_sizes
    return frozen_sizes(tensor_infos(path))


def holds_quantized(path, config: dict) -> bool:
    """Whether the model's file holds quantized weights a run may keep as they are (a
    bitsandbytes 4-bit directory, a GGUF with quantized blocks): their layout comes from
    loading them, not from the headers."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from .gguf import open_gguf
        from .quant import gguf_blocks
        return any(gguf_blocks.kind_of(t.tensor_type) for t in open_gguf(path).tensors)
    from .quant import bnb_dir
    return bnb_dir.is_bnb(config, path)
