"""The packed attention calls of builds masking documents with lorac's own kernels (mask
"kernel": compiler/targets/cuda/packed_kernels.py, compiled into cubins by packed_build.py):
the four kernels of each call shape loaded from the artifact, and their launches.

    forward   fwd                        (q, k, v, pos) -> o, lse
    backward  delta, bwd_kv, bwd_q       (q, k, v, o, do, lse, pos) -> dq, dk, dv

Tensors are passed by device address in the layout the compiler's call gives (token-major
q/o/do/dq [B, S, H, Dh], k/v/dk/dv [B, S, K, Dh], lse [B, S, H, 1] fp32, pos [B, S]); delta
([B, S, H] fp32, rowsum(o * do)) is scratch of this module's, allocated when the artifact
loads, never inside a CUDA graph capture.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import LoracError
from .kernels import Kernel

NAMES = ("fwd", "delta", "bwd_kv", "bwd_q")
BACKWARD = NAMES[1:]  # an artifact without backward calls (eval, forward) ships the forward's alone


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class PackedKernels:
    """The kernels of one packed call shape (a manifest `packed_kernels` entry)."""

    def __init__(self, entry: dict, art_dir, device_index: int, backward: bool = True):
        need = NAMES if backward else NAMES[:1]
        missing = [n for n in need if n not in entry.get("kernels", {})]
        if missing:
            raise LoracError(f"this artifact's packed attention lacks kernels {', '.join(missing)} (rebuild it)")
        self.H, self.K, self.Dh, self.S = (int(entry[k]) for k in ("H", "K", "Dh", "S"))
        self.meta = entry["kernels"]
        self.kernels = {}
        for name in need:
            m = self.meta[name]
            path = Path(art_dir) / m["file"]
            if not path.is_file():
                raise LoracError(f"this artifact's packed attention kernel {path.name} is missing (rebuild it)")
            self.kernels[name] = Kernel(path.read_bytes(), m["entry"], m["shared"], m["warps"], tuple(m["params"]),
                                        device_index)
        self.delta: dict = {}  # B -> the [B, S, H] fp32 scratch tensor

    def reserve(self, B: int, empty) -> None:
        if B not in self.delta:
            self.delta[B] = empty((B, self.S, self.H), "float32")

    def _grid(self, name: str, B: int) -> tuple:
        m = self.meta[name]
        if name == "bwd_kv":
            return _ceil(self.S, m["BN"]), B * self.K
        return _ceil(self.S, m["BM"]), B * self.H

    def _launch(self, name: str, B: int, tensors: dict, scale: float, stream) -> None:
        """One kernel, its arguments in the order the compiler recorded (`args`: tensor names,
        "scale", "S")."""
        values = [scale if a == "scale" else self.S if a == "S" else tensors[a].data_ptr()
                  for a in self.meta[name]["args"]]
        self.kernels[name].launch(self._grid(name, B), values, stream)

    def forward(self, q, k, v, pos, o, lse, scale: float, stream) -> None:
        self._launch("fwd", int(q.shape[0]), {"Q": q, "K": k, "V": v, "POS": pos, "O": o, "LSE": lse}, scale, stream)

    def backward(self, q, k, v, o, do, lse, pos, dq, dk, dv, scale: float, stream) -> None:
        B = int(q.shape[0])
        delta = self.delta.get(B)
        if delta is None:
            raise LoracError(f"packed attention: no scratch for {B} rows (the artifact's manifest does not list them)")
        t = {"Q": q, "K": k, "V": v, "O": o, "DO": do, "LSE": lse, "POS": pos, "DQ": dq, "DK": dk, "DV": dv,
             "DELTA": delta}
        for name in BACKWARD:
            self._launch(name, B, t, scale, stream)

    def warm(self, B: int, pos_dtype: str, scale: float, empty, stream) -> None:
        """Each kernel once on scratch buffers (rows of one document each): loaded now, outside
        any capture."""
        S, H, K, Dh = self.S, self.H, self.K, self.Dh
        q, o, do, dq = (empty((B, S, H, Dh), "bfloat16") for _ in range(4))
        k, v, dk, dv = (empty((B, S, K, Dh), "bfloat16") for _ in range(4))
        lse = empty((B, S, H, 1), "float32")
        pos = empty((B, S), pos_dtype)
        pos.copyfrom(np.tile(np.arange(S, dtype=pos_dtype), (B, 1)))  # the values read don't matter; the positions do
        self.forward(q, k, v, pos, o, lse, scale, stream)
        if all(n in self.kernels for n in BACKWARD):
            self.backward(q, k, v, o, do, lse, pos, dq, dk, dv, scale, stream)


def shape_of(d: dict) -> tuple:
    """(H, K, Dh, S, pos dtype) of a packed call with mask "kernel" or of a `packed_kernels` entry:
    what one set of kernels serves."""
    return d["H"], d["K"], d["Dh"], d["S"], d.get("pos_dtype")


def find_entry(manifest, call: dict) -> dict:
    """The manifest's `packed_kernels` entry of a packed call with mask "kernel"."""
    for e in manifest.extra.get("packed_kernels", []):
        if shape_of(e) == shape_of(call):
            return e
    raise LoracError(f"this artifact's packed attention call {call['function']} [{call['B']}, {call['S']}] has no "
                     "compiled kernels in its manifest (rebuild it)")
