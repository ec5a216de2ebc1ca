"""Runtime devices as modules (runtime/devices/): found from their files, one per compiler
target family; targets whose TVM runtime this machine lacks are refused up front in one
line by `lorac train`/`eval`, and `lorac compile` says so in a note."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from lorac.runtime import devices
from lorac.runtime.cli import main
from lorac.runtime.errors import LoracError

INTERFACE = ("NAME", "ORDER", "TARGETS", "DLPACK", "DEFAULT_DTYPE", "unavailable", "open")


def test_devices_are_found_from_their_files_and_cover_every_compiler_target():
    from lorac.compiler import FAMILIES

    mods = [devices.get(n) for n in devices.names()]
    assert {"cpu", "cuda", "opencl", "rocm", "vulkan", "metal", "webgpu"} <= set(devices.names())
    assert all(hasattr(d, a) for d in mods for a in INTERFACE)
    assert list(FAMILIES) == list(devices.targets())  # one listing order for compile and train
    assert devices.for_target("aarch64").NAME == "cpu" and devices.of_dlpack(2).NAME == "cuda"
    assert devices.get("cpu").unavailable("cpu") is None
    with pytest.raises(LoracError, match="unknown target 'tpu': choose one of cpu, aarch64, cuda"):
        devices.for_target("tpu")


def test_train_with_opencl_is_refused_up_front_in_one_line(capsys):
    """Before the model loads (the model path does not exist) and before any compile."""
    tvm_ffi = pytest.importorskip("tvm_ffi")
    import tvm  # noqa: F401
    if tvm_ffi.get_global_func("device_api.opencl", allow_missing=True) is not None:
        pytest.skip("this TVM runtime has OpenCL: nothing to refuse")
    for command in (["train", "--model", "/nonexistent/model"], ["eval", "--data", "/nonexistent.txt"]):
        assert main(command + ["--target", "opencl"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("lorac: error: --target opencl: its artifacts need a TVM runtime "
                                                   "built with OpenCL (USE_OPENCL=ON)"), err
    # compile-only builds for it; aarch64 is refused on another CPU the same way
    from lorac.runtime.config import TrainConfig
    TrainConfig(target="opencl", compile_only=True).validate()
    import platform
    if platform.machine() not in ("aarch64", "arm64"):
        with pytest.raises(LoracError, match="aarch64 artifacts run on a 64-bit Arm Linux machine"):
            TrainConfig(target="aarch64").validate()


def test_compile_for_opencl_says_the_artifact_needs_an_opencl_runtime(tmp_path, capsys):
    import onnx
    pytest.importorskip("tvm")
    from lorac.runtime.cli import main  # `lorac compile`: the runtime's devices add the note
    g = helper.make_graph([helper.make_node("Sigmoid", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save(model, str(tmp_path / "g.onnx"))
    assert main(["compile", str(tmp_path / "g.onnx"), "--target", "opencl", "--out", str(tmp_path / "ocl")]) == 0
    err = capsys.readouterr().err
    if not devices.get("opencl").unavailable("opencl"):
        pytest.skip("this TVM runtime has OpenCL: no note")
    assert "lorac compile: note: target opencl: its artifacts need a TVM runtime built with OpenCL" in err
    from lorac.runtime import load_artifact
    with pytest.raises(LoracError, match="device opencl: its artifacts need a TVM runtime built with OpenCL"):
        load_artifact(tmp_path / "ocl", "opencl")


def test_gemm_registry_dispatches_on_the_output_device():
    """lorac.gemm_* calls the GEMM library of the device the output lives on (here: the CPU's)."""
    tvm = pytest.importorskip("tvm")
    import tvm_ffi

    from lorac.runtime.engine import gemm
    gemm.register()
    gemm.register_accumulating(["lorac.gemm_acc_ntnn"])
    rng = np.random.default_rng(0)
    a, b, c, d = (rng.standard_normal(s).astype(np.float32) for s in ((3, 5), (4, 5), (3, 2), (2, 4)))
    out = tvm.runtime.tensor(np.zeros((3, 4), np.float32))
    tvm_ffi.get_global_func("lorac.gemm_nt")(tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    np.testing.assert_allclose(out.numpy(), a @ b.T, rtol=1e-5, atol=1e-6)
    tvm_ffi.get_global_func("lorac.gemm_acc_ntnn")(*(tvm.runtime.tensor(x) for x in (a, b, c, d)), out)
    np.testing.assert_allclose(out.numpy(), a @ b.T + c @ d, rtol=1e-5, atol=1e-6)
