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
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoracError(f"{model_dir}: no config.json (not an HF model directory)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoracError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise LoracError(f"{path}: has no model_type")
    return config


def load_hf_dir(model_dir, dtype=np.float32) -> tuple[dict, dict]:
    """(config.json dict, {HF name: array}) from an HF model directory."""
    if not os.path.isdir(model_dir):
        raise LoracError(f"model directory not found: {model_dir}")
    config = read_config(model_dir)
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(single):
        weights = load_safetensors(single, dtype)
    elif os.path.exists(index):
        weights = _load_sharded(model_dir, index, dtype)
    else:
        raise LoracError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    check_weights(config, weights, model_dir)
    return config, weights


def _weight_map(index) -> dict:
    try:
        with open(index) as f:
            return json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise LoracError(f"{index}: not a safetensors index (no weight_map)") from None


def _load_sharded(model_dir, index, dtype):
    weight_map = _weight_map(index)
    shards = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    weights = {}
    for shard, names in sorted(shards.items()):
        path = os.path.join(model_dir, shard)
        if not os.path.exists(path):
            raise LoracError(f"{index}: shard {shard} is missing")
        weights.update(load_safetensors(path, dtype, names))
    return weights


def weight_files(path) -> list:
    """The files holding a model's weights: a .gguf file, or an HF directory's safetensors."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return [os.path.join(path, s) for s in sorted(set(json.load(f)["weight_map"].values()))]


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


class TensorInfo(NamedTuple):
    """A tensor as load_model would return it, without its data: dtype, size, nbytes."""
    dtype: np.dtype
    size: int
    nbytes: int


def tensor_infos(path, dtype=np.float32) -> dict:
    """{name: TensorInfo} of what load_model(path, dtype) returns (float tensors converted to
    dtype, integer ones as stored), from the safetensors headers or the GGUF tensor infos:
    no tensor is read (`--compile-only` sizes its step from these)."""
    path, dtype = os.fspath(path), as_dtype(dtype)
    info = lambda dt, n: TensorInfo(dt, n, n * dt.itemsize)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from .gguf import architecture, hf_name, metadata, open_gguf
        reader = open_gguf(path)
        _, family = architecture(metadata(reader), path)
        return {hf_name(t.name, family): info(dtype, int(t.n_elements)) for t in reader.tensors}
    if os.path.isfile(path):
        raise LoracError(f"{path}: expected an HF model directory or a .gguf file")
    if not os.path.isdir(path):
        raise LoracError(f"model directory not found: {path}")
    single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(single):
        files = {single: None}
    elif os.path.exists(index):
        files = {}
        for name, shard in _weight_map(index).items():
            if not os.path.exists(os.path.join(path, shard)):
                raise LoracError(f"{index}: shard {shard} is missing")
            files.setdefault(os.path.join(path, shard), []).append(name)
    else:
        raise LoracError(f"{path}: no model.safetensors or model.safetensors.index.json")
    out = {}
    for file, names in files.items():
        header = read_safetensors_header(file)[0]
        for name in header if names is None else names:
            if name not in header:
                raise LoracError(f"{file}: tensor {name} is missing")
            e = header[name]
            stored = e["dtype"]
            dt = dtype if stored in ("F64", "F32", "F16", "BF16") else np.dtype(SAFETENSORS_DTYPES[stored])
            out[name] = info(dt, int(np.prod(e["shape"], dtype=np.int64)))
    return out


def frozen_sizes_of(path) -> tuple[int, int]:
    """train/memory.frozen_sizes of the weights load_model(path) would return, from headers alone."""
    from ..train.memory import frozen_sizes
    return frozen_sizes(tensor_infos(path))


def load_model(path, dtype=np.float32) -> tuple[dict, dict]:
    """(config dict, weights) from an HF model directory or a .gguf file."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from .gguf import load_gguf
        return load_gguf(path, dtype)
    if os.path.isfile(path):
        raise LoracError(f"{path}: expected an HF model directory or a .gguf file")
    return load_hf_dir(path, dtype)
