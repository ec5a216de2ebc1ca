"""lorac's packed attention kernels (compiler/targets/cuda/packed_kernels.py), without a GPU:
- their arithmetic, run by Triton's interpreter on the CPU in fp32, against causal attention
  of each document alone (torch, fp64) at several shapes: grouped-query ratios 1, 2 and 3,
  rows not a multiple of the tiles, documents of one token, rows of one document;
- their ahead-of-time build for sm_90 (packed_build.py): cubins, and the manifest entry whose
  argument list the runtime launches by (two Triton scratch pointers after them);
- the runtime's launches (runtime/devices/cuda/packed.py, kernels.py) against that entry;
- the CUDA build choosing them for packed rows, and cuDNN where it cannot (no Triton, head
  sizes the kernels do not take).
The same kernels on the GPU in bf16: bench/cudnn_isolated_check.py --speed --only kernel and
bench/h200_packed_step.py (docs/BENCHMARKS.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # the compiling side's (the runtime needs only the cubins)
pytest.importorskip("torch")  # the reference

CASES = {  # name: (heads, kv heads, head size, BM, BN, document lengths of each row)
    "gqa2": (4, 2, 16, 16, 16, [[5, 1, 20, 14], [40]]),            # a one-token document; a row of one document
    "gqa3": (6, 2, 16, 16, 32, [[1, 12, 1, 9, 14], [3, 34]]),      # key tiles wider than query tiles; S = 37
    "mha": (2, 2, 32, 32, 16, [[33], [1, 1, 1, 30]]),               # no grouping; S = 33, past one query tile
    "mqa": (4, 1, 16, 16, 16, [[7, 7, 7, 7, 7, 8]]),                # one key head for four query heads
    # a long document crossing several tiles between short ones: a query tile's keys begin at its
    # first query's document, a key tile's queries end with its last key's document
    "long": (2, 1, 16, 16, 16, [[3, 61, 2, 30], [96]]),
}


@pytest.fixture(scope="module")
def interpreted():
    """Each case's largest error relative to the reference (the kernels run by Triton's
    interpreter, which must be on before Triton is first imported: a process of its own)."""
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("_packed_kernels_interpreted.py")),
                        json.dumps(CASES)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_equal_each_document_alone(interpreted, case):
    errors = interpreted[case]
    assert sorted(errors) == ["dk", "dq", "dv", "lse", "o"]
    assert all(e < 1e-5 for e in errors.values()), errors


# -- ahead of time ---------------------------------------------------------------------------
CALL = {"function": "lorac.attention_packed_fwd", "B": 2, "S": 40, "H": 6, "K": 2, "Dh": 16, "scale": 0.25,
        "mask": "kernel", "pos_dtype": "int64"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from lorac.compiler.targets.cuda import packed_build
    import triton
    out, caches = tmp_path_factory.mktemp("packed"), []
    real = triton.compile
    mp = pytest.MonkeyPatch()
    mp.setattr(triton, "compile", lambda *a, **kw: caches.append(triton.knobs.cache.dir) or real(*a, **kw))
    try:
        entries = packed_build.export([CALL, {**CALL, "function": "lorac.attention_packed_bwd"},
                                       {**CALL, "mask": "bias"}], out, "sm_90")
    finally:
        mp.undo()
    # Triton's cache was a temporary folder, gone now (not ~/.triton)
    assert len(caches) == 4 and all("lorac-triton-" in c and not Path(c).exists() for c in caches), caches
    assert triton.knobs.cache.dir not in caches
    return out, entries


def test_build_writes_a_cubin_per_kernel(built):
    """... and nothing else: Triton's cache lives in a temporary folder (not ~/.triton)."""
    out, entries = built
    assert sorted(p.suffix for p in out.iterdir()) == [".cubin"] * 4
    assert len(entries) == 1  # one shape: the forward and backward calls share it; the bias call has none
    e = entries[0]
    assert (e["H"], e["K"], e["Dh"], e["S"], e["pos_dtype"]) == (6, 2, 16, 40, "int64")
    assert sorted(e["kernels"]) == ["bwd_kv", "bwd_q", "delta", "fwd"]
    for name, k in e["kernels"].items():
        blob = (out / k["file"]).read_bytes()
        assert blob[:4] == b"\x7fELF" and k["entry"] == name
        assert len(k["args"]) == len(k["params"]) and k["params"][k["args"].index("S")] == "i32"
        assert k["warps"] >= 1 and k["shared"] >= 0


def test_forward_calls_alone_build_the_forward_kernel_alone(tmp_path):
    """An eval or forward artifact (no backward call) ships the forward kernel only."""
    from lorac.compiler.targets.cuda import packed_build
    [entry] = packed_build.export([CALL], tmp_path, "sm_90")
    assert list(entry["kernels"]) == ["fwd"] and len(list(tmp_path.glob("*.cubin"))) == 1


def test_compiled_kernels_take_the_scratch_pointers_the_runtime_passes():
    """Each kernel's PTX entry has its arguments plus the two scratch pointers the runtime
    appends (kernels.SCRATCH_POINTERS), and needs no scratch memory."""
    from lorac.compiler.targets.cuda import packed_build
    from lorac.runtime.devices.cuda.kernels import SCRATCH_POINTERS
    for name in packed_build.CONFIGS:
        k = packed_build.compile_kernel(name, 4, 2, 16, 40, "int32", "sm_90")
        entry = k.asm["ptx"].split(".entry", 1)[1].split(")", 1)[0]
        assert entry.count(".param") == len(packed_build.params(name)) + SCRATCH_POINTERS, name


def test_unsupported_shapes_are_refused():
    from lorac.compiler.targets.cuda import packed_build
    from lorac.core.errors import LoracError
    assert packed_build.supports(16, 8, 128) and not packed_build.supports(16, 8, 96)
    assert not packed_build.supports(6, 4, 64) and not packed_build.supports(8, 8, 8)
    with pytest.raises(LoracError, match="head sizes 16, 32, 64, 128"):
        packed_build.export([{**CALL, "Dh": 96}], Path("."), "sm_90")
    with pytest.raises(LoracError, match="position ids of float32"):
        packed_build.compile_kernel("fwd", 4, 2, 16, 40, "float32", "sm_90")


# -- the runtime's launches -------------------------------------------------------------------
class _Tensor:
    def __init__(self, ptr, shape):
        self.ptr, self.shape = ptr, shape

    def data_ptr(self):
        return self.ptr


def test_runtime_loads_what_its_calls_need(built, monkeypatch, tmp_path):
    from lorac.runtime.devices.cuda import packed
    from lorac.runtime.errors import LoracError
    out, entries = built
    loaded = []
    monkeypatch.setattr(packed, "Kernel", lambda cubin, name, *a: loaded.append(name) or name)
    packed.PackedKernels(entries[0], out, 0, backward=False)
    assert loaded == ["fwd"]
    forward_only = {**entries[0], "kernels": {"fwd": entries[0]["kernels"]["fwd"]}}
    with pytest.raises(LoracError, match="lacks kernels delta, bwd_kv, bwd_q"):
        packed.PackedKernels(forward_only, out, 0, backward=True)
    with pytest.raises(LoracError, match="is missing"):
        packed.PackedKernels(entries[0], tmp_path, 0)


def test_runtime_launches_each_kernel_with_the_compiled_arguments(built, monkeypatch):
    from lorac.runtime.devices.cuda import packed
    out, entries = built
    launches = []

    class Recorder:
        def __init__(self, cubin, name, shared, warps, params, device_index):
            assert cubin[:4] == b"\x7fELF"
            self.name, self.params = name, params

        def launch(self, grid, values, stream):
            assert len(values) == len(self.params)
            launches.append((self.name, grid, values, stream))

    monkeypatch.setattr(packed, "Kernel", Recorder)
    pk = packed.PackedKernels(entries[0], out, 0)
    B, S, H, K, D = 2, 40, 6, 2, 16
    pk.reserve(B, lambda shape, dtype: _Tensor(999, shape))
    t = {n: _Tensor(i + 1, s) for i, (n, s) in enumerate([("q", (B, S, H, D)), ("k", (B, S, K, D)), ("v", (B, S, K, D)),
                                                          ("o", (B, S, H, D)), ("do", (B, S, H, D)), ("lse", (B, S, H, 1)),
                                                          ("pos", (B, S)), ("dq", (B, S, H, D)), ("dk", (B, S, K, D)),
                                                          ("dv", (B, S, K, D))])}
    pk.forward(t["q"], t["k"], t["v"], t["pos"], t["o"], t["lse"], 0.25, "stream")
    pk.backward(*(t[n] for n in ("q", "k", "v", "o", "do", "lse", "pos", "dq", "dk", "dv")), 0.25, "stream")
    ptr = {n: x.ptr for n, x in t.items()}
    fwd_bm, kv_bn = entries[0]["kernels"]["fwd"]["BM"], entries[0]["kernels"]["bwd_kv"]["BN"]  # grids from the tiles
    assert [x[0] for x in launches] == ["fwd", "delta", "bwd_kv", "bwd_q"]
    assert launches[0][1:] == ((-(-S // fwd_bm), B * H), [ptr[n] for n in ("q", "k", "v", "pos", "o", "lse")] + [0.25, S],
                               "stream")
    assert launches[1][2] == [ptr["o"], ptr["do"], 999, S]
    assert launches[2][1] == (-(-S // kv_bn), B * K)
    assert launches[2][2] == [ptr[n] for n in ("q", "k", "v", "do", "lse")] + [999] + [ptr[n] for n in
                                                                                   ("pos", "dk", "dv")] + [0.25, S]
    assert launches[3][2] == [ptr[n] for n in ("q", "k", "v", "do", "lse")] + [999, ptr["pos"], ptr["dq"], 0.25, S]


def test_kernel_arguments_end_with_null_scratch_pointers():
    import ctypes

    from lorac.runtime.devices.cuda.kernels import Kernel
    from lorac.runtime.errors import LoracError
    k = Kernel.__new__(Kernel)
    k.name, k.params = "fwd", ("ptr", "f32", "i32")
    held, ptrs = k.arguments([1234, 0.5, 40])
    assert [type(h) for h in held] == [ctypes.c_void_p, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p,
                                       ctypes.c_void_p]
    assert held[0].value == 1234 and held[1].value == 0.5 and held[2].value == 40 and not held[3].value
    assert len(ptrs) == 5 and ptrs[1] == ctypes.addressof(held[1])
    with pytest.raises(LoracError, match="takes 3 arguments, given 2"):
        k.arguments([1, 2])


# -- the CUDA build's choice ------------------------------------------------------------------
def test_cuda_build_runs_packed_rows_on_the_kernels(monkeypatch, capsys):
    pytest.importorskip("tvm")
    from tvm import relax
    from lorac.compiler.targets.cuda import attention as cuda_attention
    from lorac.compiler.targets.cuda import packed_build
    from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph
    from test_compiler_gpu_passes import _cuda_plan
    from _compiler_graphs import SMALL_QWEN3
    spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "head_dim": 16})
    model = build_training_graph(spec, TrainSpec(batch=2, seq=9, rank=4, lora_targets=tuple(ALL_TARGETS),
                                                 packing="isolated"))
    calls = []
    relax.analysis.post_order_visit(_cuda_plan(model, "bfloat16")["_mod"]["main"], lambda e: isinstance(e, relax.Call)
                                    and isinstance(e.op, relax.ExternFunc)
                                    and e.op.global_symbol.startswith("lorac.attention") and calls.append(e))
    assert len(calls) == 4
    for c in calls:  # the position ids themselves, read by the kernels
        at = 3 if c.op.global_symbol == "lorac.attention_packed_fwd" else 6
        assert [int(d) for d in c.args[at].ty.shape.values] == [2, 9] and c.args[at].ty.dtype == "int64"
    fwd = next(c for c in calls if c.op.global_symbol == "lorac.attention_packed_fwd")
    assert [int(d) for d in fwd.args[-1].ty.shape.values] == [2, 9, spec.heads, 1]  # lse token-major
    assert cuda_attention.packed_mask(8, 1024, 16, 8, 128) == "kernel"
    assert cuda_attention.packed_mask(8, 1024, 32, 8, 96) == "bias"  # Phi-3's head size: cuDNN
    assert cuda_attention.packed_mask(2, 4096, 16, 8, 128) == "kernel"
    assert cuda_attention.packed_mask(1, 8192, 16, 8, 128) == "ragged"  # past KERNEL_MAX_SEQ: cuDNN's ragged
    monkeypatch.setattr(packed_build, "unavailable", lambda: "Triton is not installed (test)")
    monkeypatch.setattr(cuda_attention, "_told", [])
    assert cuda_attention.packed_mask(8, 1024, 16, 8, 128) == "bias"
    assert cuda_attention.packed_mask(4, 2048, 16, 8, 128) == "ragged"
    assert capsys.readouterr().err.count("packed documents masked on cuDNN") == 1  # told once


def test_compiled_artifact_lists_its_kernels(tmp_path):
    """A bf16 CUDA build of packed rows (nvcc needed for TVM's own kernels) ships the cubins and
    lists them in the manifest, sealed with the rest."""
    import shutil
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    pytest.importorskip("tvm")
    from lorac.compiler import compile_graph
    from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph
    from _compiler_graphs import SMALL_QWEN3
    spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "head_dim": 16, "num_attention_heads": 6})
    model = build_training_graph(spec, TrainSpec(batch=2, seq=40, rank=4, lora_targets=tuple(ALL_TARGETS),
                                                 packing="isolated"))
    d = compile_graph(model, target="cuda", out_dir=tmp_path / "cuda", dtype="bfloat16")
    m = json.loads((d / "manifest.json").read_text())
    assert {(c["function"], c["mask"], c["pos_dtype"]) for c in m["unit_calls"]} == {
        ("lorac.attention_packed_fwd", "kernel", "int64"), ("lorac.attention_packed_bwd", "kernel", "int64")}
    [entry] = m["extra"]["packed_kernels"]
    assert (entry["H"], entry["K"], entry["Dh"], entry["S"]) == (6, 2, 16, 40)
    from lorac.runtime.devices.cuda.packed import find_entry
    from lorac.core.manifest import Manifest
    assert find_entry(Manifest.from_json(m), m["unit_calls"][0]) == entry
    for k in entry["kernels"].values():
        assert (d / k["file"]).is_file()


def test_feeder_checks_the_positions_the_kernels_read():
    """An artifact on lorac's kernels takes positions numbering each document 0, 1, 2, ... (the
    kernels skip key tiles by the documents' starts); others are refused before the step runs."""
    from types import SimpleNamespace

    import numpy as np
    from lorac.runtime.devices.cuda import attention
    from lorac.runtime.errors import LoracError
    calls = [{**CALL, "function": fn} for fn in (attention.PACKED_FWD, attention.PACKED_BWD)]
    feed = attention.feeder(SimpleNamespace(unit_calls=calls))
    good = np.array([[0, 1, 2, 0, 1], [3, 4, 0, 0, 1]])  # a row may begin inside a document cut there
    feed({"position_ids": good})
    with pytest.raises(LoracError, match="row 1: position 5 at token 1 follows 3"):
        feed({"position_ids": np.array([[0, 1, 2, 0, 1], [3, 5, 0, 0, 1]])})
    with pytest.raises(LoracError, match="needs the input position_ids"):
        feed({})
    assert attention.feeder(SimpleNamespace(unit_calls=[{**c, "mask": "bias"} for c in calls])) is None


def test_kernels_load_once_a_shape(monkeypatch):
    """A training artifact's forward and backward calls share one set of the four kernels, run
    once on scratch buffers; an eval artifact of the same shape reuses it, and one loaded first
    (its forward alone) gives way to the full set when a training artifact comes."""
    from types import SimpleNamespace

    from lorac.runtime.devices.cuda import attention
    made = []

    class Fake:
        def __init__(self, entry, art_dir, device_index, backward=True):
            self.kernels = dict.fromkeys(("fwd", "delta", "bwd_kv", "bwd_q") if backward else ("fwd",))
            self.delta, self.warmed = {}, 0
            made.append(self)

        def reserve(self, B, empty):
            self.delta.setdefault(B, None)

        def warm(self, *a):
            self.warmed += 1

    monkeypatch.setattr(attention, "PackedKernels", Fake)
    monkeypatch.setattr(attention, "find_entry", lambda manifest, call: {})
    dev = SimpleNamespace(index=0)
    fwd, bwd = ({**CALL, "function": fn} for fn in (attention.PACKED_FWD, attention.PACKED_BWD))
    try:
        evaluation = SimpleNamespace(unit_calls=[fwd])
        attention.load_kernels(evaluation, fwd, ".", dev, None)
        assert len(made) == 1 and list(made[0].kernels) == ["fwd"]
        train = SimpleNamespace(unit_calls=[fwd, bwd])
        for call in train.unit_calls:
            attention.load_kernels(train, call, ".", dev, None)
        assert len(made) == 2 and len(made[1].kernels) == 4 and made[1].warmed == 1
        assert attention._kernels[attention._key(fwd)[:-1]][0] is attention._kernels[attention._key(bwd)[:-1]][0]
        attention.load_kernels(evaluation, fwd, ".", dev, None)  # again: the full set serves it
        assert len(made) == 2 and attention._kernels[attention._key(fwd)[:-1]][0] is made[1]
    finally:
        attention._kernels.clear()
        attention._kernel_sets.clear()
