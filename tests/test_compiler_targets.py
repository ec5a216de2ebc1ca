"""Every target either writes an artifact or stops with one clear lorac error; the cuBLAS
argument mapping; CUDA artifacts on a real GPU (marked gpu, skipped without one)."""
from __future__ import annotations

import ctypes
import json
import shutil

import numpy as np
import pytest
from onnx import TensorProto, helper

from _compiler_graphs import count_matmuls, random_inputs, small_training_graph
from lorac.compiler import compile_graph
from lorac.runtime.errors import LoracError


@pytest.fixture(scope="module")
def graph():
    return small_training_graph()


def _manifest(d):
    return json.loads((d / "manifest.json").read_text())


def test_cuda_artifact_ships_compiled_kernels(graph, tmp_path):
    if shutil.which("nvcc") is None:
        with pytest.raises(LoracError, match="needs nvcc"):
            compile_graph(graph, target="cuda", out_dir=tmp_path / "cuda")
        pytest.skip("no nvcc here: checked the error instead")
    d = compile_graph(graph, target="cuda", out_dir=tmp_path / "cuda")
    m = _manifest(d)
    assert m["target"]["tvm"]["kind"] == "cuda" and m["target"]["tvm"]["arch"] == "sm_90"
    fatbin = (d / m["extra"]["cuda_fatbin"]).read_bytes()
    assert fatbin[:4] == bytes.fromhex("50ed55ba")  # fatbin magic 0xBA55ED50, little-endian
    assert len(m["extra"]["cuda_source_sha256"]) == 64
    assert m["gemm"]["dispatched"] == count_matmuls(graph) and m["units"] == []  # fp32: units inlined


def test_cuda_bf16_manifest_types(graph, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    m = _manifest(compile_graph(graph, target="cuda", out_dir=tmp_path / "bf16", dtype="bfloat16"))
    types = {i["name"]: i["dtype"] for i in m["inputs"]}
    assert types["input_ids"] == "int64"
    assert types["model.layers.0.mlp.up_proj.weight"] == "bfloat16"
    assert types["model.norm.weight"] == "bfloat16"
    assert all(t == "float32" for n, t in types.items() if "lora_" in n)
    # bf16: attention runs on cuDNN (its shapes and scale are in the manifest for the runtime)
    assert m["units"] == ["CausalAttention", "CausalAttentionGrad", "SwiGLUGrad"]  # SwiGLU: compiler/units/swiglu.py
    assert m["gemm"]["dispatched"] == count_matmuls(graph, units_inlined=False)
    B, S = m["inputs"][0]["shape"]
    assert sorted(c["function"] for c in m["unit_calls"]) == ["lorac.attention_bwd", "lorac.attention_fwd"]
    assert all(dict(B=c["B"], S=c["S"], H=c["H"], K=c["K"], Dh=c["Dh"]) == dict(B=B, S=S, H=4, K=2, Dh=8)
               and abs(c["scale"] - 8 ** -0.5) < 1e-7 for c in m["unit_calls"])
    assert all(o["dtype"] == "float32" for o in m["outputs"])


def test_cuda_graph_build_binds_its_inputs(graph, tmp_path):
    """`lorac compile --cuda-graph` builds with every input bound (manifest bound_inputs); a
    plain build does not. The graphs themselves run on the GPU machine (docs/BENCHMARKS.md)."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    import onnx

    from lorac.compiler.cli import compile_command
    path, out = tmp_path / "train.onnx", tmp_path / "graph"
    onnx.save(graph, str(path))
    assert compile_command([str(path), "--target", "cuda", "--dtype", "bfloat16", "--cuda-graph", "--out", str(out), "-q"]) == 0
    m = _manifest(out)
    assert m["bound_inputs"] is True and m["target"]["request"] == {"kind": "cuda", "cuda_graph": True}
    assert _manifest(compile_graph(graph, target="cuda", out_dir=tmp_path / "plain"))["bound_inputs"] is False


def test_opencl(graph, tmp_path):
    d = compile_graph(graph, target="opencl", out_dir=tmp_path / "ocl")
    m = _manifest(d)
    assert m["target"]["tvm"]["kind"] == "opencl" and (d / "lib.so").is_file()
    assert m["gemm"]["dispatched"] == 0  # no GEMM library: TVM's DLight kernels


def test_aarch64(graph, tmp_path):
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        with pytest.raises(LoracError, match="apt-get install gcc-aarch64-linux-gnu"):
            compile_graph(graph, target="aarch64", out_dir=tmp_path / "arm")
        pytest.skip("cross linker missing: checked the error instead")
    d = compile_graph(graph, target="aarch64", out_dir=tmp_path / "arm")
    elf = (d / "lib.so").read_bytes()[:20]
    assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 183  # EM_AARCH64
    assert _manifest(d)["target"]["device"] == "cpu"


def test_vulkan_compiles_where_tvm_has_its_codegen(graph, tmp_path):
    """The apache-tvm wheel has no Vulkan code generator: one error naming it, at once."""
    import tvm_ffi
    if tvm_ffi.get_global_func("target.build.vulkan", allow_missing=True) is not None:
        assert (compile_graph(graph, target="vulkan", out_dir=tmp_path / "vk") / "lib.so").is_file()
        return
    with pytest.raises(LoracError, match=r"target vulkan: this TVM .* has no Vulkan code generator"):
        compile_graph(graph, target="vulkan", out_dir=tmp_path / "vk")


def test_webgpu_is_32_bit(graph, tmp_path):
    d = compile_graph(graph, target="webgpu", out_dir=tmp_path / "web")
    m = _manifest(d)
    types = {i["name"]: i["dtype"] for i in m["inputs"]}
    assert types["input_ids"] == "int32" and types["labels"] == "int32"
    import tarfile
    with tarfile.open(d / "lib.tar") as tar:
        names = tar.getnames()
        first = tar.extractfile(names[0]).read(4)
    assert first == b"\0asm"  # wasm32 objects holding the WGSL kernels


def test_rocm_artifact_or_clear_error(graph, tmp_path):
    try:
        d = compile_graph(graph, target="rocm", out_dir=tmp_path / "rocm")
    except LoracError as e:
        assert "target rocm needs" in str(e) or "target rocm" in str(e)
    else:
        assert (d / "lib.so").is_file()


def test_metal_crash_becomes_an_error(tmp_path):
    # one GEMM graph: the crash (or a build) is reached quickly
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Sigmoid", ["y"], ["z"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64]),
                                helper.make_tensor_value_info("w", TensorProto.FLOAT, [64, 64])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [64, 64])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    try:
        d = compile_graph(model, target="metal", out_dir=tmp_path / "metal")
    except LoracError as e:
        assert "target metal" in str(e)
    else:
        assert (d / "lib.so").is_file()


def test_unsupported_op_is_named(tmp_path):
    g = helper.make_graph([helper.make_node("Loop", ["n", "c"], ["y"], body=helper.make_graph([], "b", [], []))],
                          "g", [helper.make_tensor_value_info("n", TensorProto.INT64, []),
                                helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(LoracError, match="cannot convert these ops: Loop"):
        compile_graph(model, target="cpu", out_dir=tmp_path / "x")


# --- cuBLAS argument mapping, checked without a GPU --------------------------------------

class _Buf:
    """A host array posing as a device tensor (shape, dtype, data_ptr)."""
    pool: dict = {}

    def __init__(self, arr):
        self.arr = np.ascontiguousarray(arr)
        self.shape, self.dtype = self.arr.shape, str(self.arr.dtype)
        self.device = type("Device", (), {"index": 0})()
        _Buf.pool[self.arr.ctypes.data] = self.arr

    def data_ptr(self):
        return self.arr.ctypes.data


def _colmajor(ptr, rows, cols, ld, stride, batch):
    flat = _Buf.pool[ptr].reshape(-1)
    view = np.lib.stride_tricks.as_strided
    return [view(flat[i * stride:], (rows, cols), (flat.itemsize, ld * flat.itemsize)) for i in range(batch)]


def _fake_gemm_strided_batched(h, ta, tb, m, n, k, alpha, A, at, lda, sA, B, bt, ldb, sB, beta,
                               C, ct, ldc, sC, batch, compute, algo):
    """cublasGemmStridedBatchedEx's column-major semantics, in numpy."""
    As = _colmajor(A, *((m, k) if ta == 0 else (k, m)), lda, sA, batch)
    Bs = _colmajor(B, *((k, n) if tb == 0 else (n, k)), ldb, sB, batch)
    Cs = _colmajor(C, m, n, ldc, sC, batch)
    for a, b, c in zip(As, Bs, Cs):
        c[...] = (a if ta == 0 else a.T) @ (b if tb == 0 else b.T)
    return 0


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("batch_a,batch_b", [((), ()), ((2, 3), (2, 3)), ((2, 3), ())])
def test_cublas_mapping(monkeypatch, ta, tb, batch_a, batch_b):
    from lorac.runtime.devices.cuda import cublas as gemm_cuda
    monkeypatch.setattr(gemm_cuda, "_fn", _fake_gemm_strided_batched)
    monkeypatch.setattr(gemm_cuda, "_handle", ctypes.c_void_p(1))
    monkeypatch.setattr(gemm_cuda, "_get_stream", lambda device_type, device_id: None)
    rng = np.random.default_rng(0)
    M, K, N = 5, 7, 4
    a = rng.standard_normal(batch_a + ((K, M) if ta else (M, K))).astype(np.float32)
    b = rng.standard_normal(batch_b + ((N, K) if tb else (K, N))).astype(np.float32)
    out = _Buf(np.zeros(batch_a + (M, N), np.float32))
    gemm_cuda.gemm(ta, tb, _Buf(a), _Buf(b), out)
    want = np.matmul(np.swapaxes(a, -1, -2) if ta else a, np.swapaxes(b, -1, -2) if tb else b)
    np.testing.assert_allclose(out.arr, want, rtol=1e-5, atol=1e-5)


# --- on a real GPU ------------------------------------------------------------------------

@pytest.mark.gpu  # skipped without a CUDA GPU (conftest.py)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_matches_cpu(graph, tmp_path, dtype):
    assert_cuda_matches_cpu(graph, random_inputs(graph), tmp_path, dtype)


def assert_cuda_matches_cpu(graph, inputs: dict, tmp_path, dtype: str) -> None:
    """The CUDA artifact of `graph` against its CPU artifact on `inputs`: fp32 to 1e-4 of the
    largest value; bf16 the loss within 1e-2 and every gradient's cosine >= 0.999."""
    from lorac.runtime.engine.artifact import load_artifact
    want = load_artifact(compile_graph(graph, target="cpu", out_dir=tmp_path / "cpu"))(inputs)
    got = load_artifact(compile_graph(graph, target="cuda", out_dir=tmp_path / "cuda", dtype=dtype), "cuda")(inputs)
    for name, ref in want.items():
        g, w = got[name].astype(np.float64).ravel(), ref.astype(np.float64).ravel()
        if dtype == "float32":
            assert np.abs(g - w).max() <= 1e-4 * np.abs(w).max(), name
        elif name == "loss":
            assert abs(g[0] - w[0]) <= 1e-2 * abs(w[0])
        else:
            assert g @ w / (np.linalg.norm(g) * np.linalg.norm(w)) >= 0.999, name
