"""onnxruntime's WebGPU plugin (runtime/engine/ort_webgpu.py, `lorac train --target webgpu`)
without a GPU: the plugin's registration and its refusals, the choice of its device entry,
the one-line error where no adapter is found (naming the Vulkan loader on Linux), the
--target/--backend/--ort-providers spellings, and the graphs' integer math in int32 (WebGPU
has no 64-bit integers: onnxruntime's WebGPU EP ran int64 nodes on the CPU)."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from lorac.runtime.engine import ort_webgpu
from lorac.runtime.errors import LoracError


def _entry(ep: str, kind: str = "GPU", vendor: str = "NVIDIA", **meta):
    hw = SimpleNamespace(type=f"OrtHardwareDeviceType.{kind}", vendor=vendor, vendor_id=0x10DE, device_id=0x2335, metadata=meta)
    return SimpleNamespace(ep_name=ep, device=hw, ep_metadata={"version": "0.4.0"})


def test_the_webgpu_entry_is_chosen_gpu_first():
    cpu, wcpu, wgpu = _entry("CPUExecutionProvider", "CPU"), _entry(ort_webgpu.EP, "CPU"), _entry(ort_webgpu.EP)
    assert ort_webgpu.choose([cpu, wcpu, wgpu]) is wgpu
    assert ort_webgpu.choose([cpu, wcpu]) is wcpu
    assert ort_webgpu.choose([cpu]) is None and ort_webgpu.choose([]) is None
    info = ort_webgpu.describe(_entry(ort_webgpu.EP, Discrete="1", pci_bus_id="0000:19:00.0"))
    assert info["vendor"] == "NVIDIA" and info["vendor_id"] == "0x10de" and info["device_id"] == "0x2335"
    assert info["type"] == "GPU" and info["metadata"]["Discrete"] == "1" and info["metadata"]["ep.version"] == "0.4.0"
    assert info["graphics_api"] in ("Vulkan", "Metal", "D3D12") or info["graphics_api"]
    assert info["graphics_api_from"].endswith("'s default")
    chosen = ort_webgpu.describe(_entry(ort_webgpu.EP), {"dawnBackendType": "Vulkan", "validationMode": "basic"})
    assert (chosen["graphics_api"], chosen["graphics_api_from"]) == ("Vulkan", "the dawnBackendType option")


def test_no_adapter_is_one_line_naming_what_to_install():
    linux = ort_webgpu.no_adapter("Linux", vulkan_loader=False)
    assert "libvulkan.so.1 is not installed" in linux and "apt install libvulkan1" in linux and "dpkg -x" in linux
    driver = ort_webgpu.no_adapter("Linux", vulkan_loader=True)
    assert "offers no GPU" in driver and "VK_DRIVER_FILES" in driver and "mesa-vulkan-drivers" in driver
    assert "Metal" in ort_webgpu.no_adapter("Darwin") and "D3D12" in ort_webgpu.no_adapter("Windows")
    for msg in (linux, driver, ort_webgpu.no_adapter("Darwin"), ort_webgpu.no_adapter("Windows")):
        assert msg.startswith("--target webgpu: onnxruntime's WebGPU plugin found no GPU adapter") and "\n" not in msg


class _FakeOrt:
    """An onnxruntime module as far as registration goes: a version and a recorder."""

    def __init__(self, version: str, fail: str | None = None):
        self.__version__, self.fail, self.calls = version, fail, []

    def register_execution_provider_library(self, name, path):
        self.calls.append((name, path))
        if self.fail:
            raise RuntimeError(self.fail)

    def get_ep_devices(self):
        return [_entry("CPUExecutionProvider", "CPU")]


def test_registration_refusals_are_one_line(monkeypatch):
    plugin = SimpleNamespace(get_library_path=lambda: "/x/libonnxruntime_providers_webgpu.so")
    monkeypatch.setitem(sys.modules, "onnxruntime_ep_webgpu", plugin)
    with pytest.raises(LoracError, match=r"needs onnxruntime >= 1\.24\.4 .* this one is 1\.20\.1: pip install "
                                         r"'lorac\[webgpu\]'"):
        ort_webgpu.register(_FakeOrt("1.20.1"))
    bad = _FakeOrt("1.24.4", 'ORT runtime version "1.24.4" is below the minimum required version "1.26"\nmore')
    with pytest.raises(LoracError, match=r"refused the WebGPU plugin \(ORT runtime version .*1\.26\"\); pip install"):
        ort_webgpu.register(bad)
    again = _FakeOrt("1.30.0", "EP library is already registered under webgpu")
    ort_webgpu.register(again)  # registered by someone else first: fine
    ort_webgpu.register(again)  # and only once per onnxruntime module
    assert again.calls == [("webgpu", "/x/libonnxruntime_providers_webgpu.so")]
    with pytest.raises(LoracError, match="found no GPU adapter"):
        ort_webgpu.open_device(again)  # registered, but the device list has no WebGPU entry
    monkeypatch.setitem(sys.modules, "onnxruntime_ep_webgpu", None)
    with pytest.raises(LoracError, match=r"needs onnxruntime's WebGPU plugin \(onnxruntime-ep-webgpu\): pip install "
                                         r"'lorac\[webgpu\]'"):
        ort_webgpu.register(_FakeOrt("1.32.0"))


def test_the_installed_plugin_registers_with_the_installed_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxruntime_ep_webgpu")
    ort_webgpu.register(ort)
    ort_webgpu.register(ort)  # idempotent
    dev = ort_webgpu.choose(ort.get_ep_devices())
    if dev is None:  # this machine: the plugin loads and lists no adapter
        with pytest.raises(LoracError, match="found no GPU adapter"):
            ort_webgpu.check()
    else:
        assert dev.ep_name == ort_webgpu.EP


def test_train_without_an_adapter_fails_in_one_line_before_loading(capsys):
    pytest.importorskip("onnxruntime_ep_webgpu")
    import onnxruntime
    ort_webgpu.register(onnxruntime)
    if ort_webgpu.choose(onnxruntime.get_ep_devices()) is not None:
        pytest.skip("this machine has a WebGPU adapter")
    from lorac.runtime.cli import main
    for command in (["train", "--model", "/nonexistent/model"], ["eval", "--data", "/nonexistent.txt"],
                    ["generate", "--prompt", "hi"]):
        for spelling in (["--target", "webgpu"], ["--backend", "ort", "--ort-providers", "webgpu"]):
            assert main(command + spelling) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("lorac: error: --target webgpu: onnxruntime's WebGPU plugin "
                                                       "found no GPU adapter"), err


def test_target_webgpu_is_backend_ort_and_the_reverse(monkeypatch):
    from lorac.runtime.config import TrainConfig
    checked = []
    monkeypatch.setattr(ort_webgpu, "check", lambda: checked.append(1))
    a = TrainConfig(target="webgpu")
    a.validate()
    assert (a.backend, a.target, a.ort_providers) == ("ort", "webgpu", None)
    b = TrainConfig(backend="ort", ort_providers="WebGpuExecutionProvider,cpu")
    b.validate()
    assert (b.backend, b.target) == ("ort", "webgpu") and len(checked) == 2
    c = TrainConfig(target="webgpu", compile_only=True)  # TVM's webgpu artifacts, for browsers
    c.validate()
    assert (c.backend, c.target) == ("tvm", "webgpu") and len(checked) == 2
    d = TrainConfig(backend="ort", ort_providers="cpu")
    d.validate()
    assert d.target == "cpu"


def test_provider_options_are_checked_against_the_plugins(monkeypatch):
    """LORAC_ORT_EP_OPTIONS reaches the plugin over DEFAULTS; a key or value the plugin does not
    read, and graph capture (lorac's step rebinds its buffers), are one line each."""
    monkeypatch.setattr(ort_webgpu, "DEFAULTS", {"validationMode": "disabled", "maxNumPendingDispatches": "64"})
    monkeypatch.setenv("LORAC_ORT_EP_OPTIONS", " validationMode = basic ; storageBufferCacheMode=simple;")
    assert ort_webgpu.options() == {"validationMode": "basic", "maxNumPendingDispatches": "64",
                                    "storageBufferCacheMode": "simple"}
    monkeypatch.delenv("LORAC_ORT_EP_OPTIONS")
    assert ort_webgpu.options() == {"validationMode": "disabled", "maxNumPendingDispatches": "64"}
    assert ort_webgpu.options("dawnBackendType=Vulkan;enableInt64=1")["enableInt64"] == "1"
    for text, why in (("validationmode=disabled", r"'validationmode' is not one of the WebGPU plugin's options lorac "
                                                  r"passes: validationMode, "),
                      ("validationMode=off", r"validationMode='off': the WebGPU plugin takes disabled \| wgpuOnly"),
                      ("maxNumPendingDispatches=", r"maxNumPendingDispatches='': the WebGPU plugin takes a value"),
                      ("validationMode", r"'validationMode' is not key=value"),
                      ("enableGraphCapture=1", r"enableGraphCapture=1 is not supported: lorac's step binds")):
        with pytest.raises(LoracError, match=r"^LORAC_ORT_EP_OPTIONS: " + why) as e:
            ort_webgpu.options(text)
        assert "\n" not in str(e.value)
    assert ort_webgpu.options("enableGraphCapture=0")["enableGraphCapture"] == "0"


def test_session_settings_reach_the_session_options(monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    so = ort.SessionOptions()
    ort_webgpu.configure(so, ort)  # nothing by default: onnxruntime's own settings
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL and so.enable_mem_pattern
    monkeypatch.setattr(ort_webgpu, "SESSION", {"graph_optimization_level": "ORT_ENABLE_EXTENDED",
                                                "enable_mem_pattern": False})
    ort_webgpu.configure(so, ort)
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED and not so.enable_mem_pattern


def test_providers_take_the_plugin_by_its_short_name():
    from lorac.runtime.engine.ort import resolve_providers
    have = ["AzureExecutionProvider", "CPUExecutionProvider"]
    assert resolve_providers("webgpu,cpu", have) == [ort_webgpu.EP, "CPUExecutionProvider"]
    with pytest.raises(LoracError, match=r"no metal; it has AzureExecutionProvider, CPUExecutionProvider \(and, as a "
                                         r"plugin, WebGpuExecutionProvider\)"):
        resolve_providers("metal", have)


def _int64_math(model) -> set[tuple[str, str]]:
    """(op type, role) of every node that reads a runtime int64 value (not a constant that
    onnxruntime folds), units inlined: what onnxruntime's WebGPU EP would run in int64."""
    import onnx
    from onnx import inliner, shape_inference
    m = shape_inference.infer_shapes(inliner.inline_local_functions(model))
    types = {v.name: v.type.tensor_type.elem_type for v in [*m.graph.input, *m.graph.value_info, *m.graph.output]}
    runtime = {i.name for i in m.graph.input} - {i.name for i in m.graph.initializer}
    found = set()
    for node in m.graph.node:
        live = [x for x in node.input if x in runtime]
        if not live:
            continue
        runtime.update(node.output)
        for k, x in enumerate(node.input):
            if x in runtime and types.get(x) == onnx.TensorProto.INT64:
                found.add((node.op_type, "indices" if node.op_type == "Gather" and k == 1 else "data"))
    return found


@pytest.mark.parametrize("packing", ["plain", "isolated"])
def test_the_graphs_compute_no_int64(packing):
    """The training and eval graphs (as the onnxruntime engine runs them: flat LoRA buckets)
    read their int64 inputs only to cast them to int32 or as Gather indices (the embedding,
    RoPE rows), which the WebGPU EP runs; every comparison, select and shift is int32."""
    from lorac.graphs import ModelSpec, TrainSpec, build_eval_graph, build_training_graph
    from lorac.graphs.flat_lora import flat_lora_io
    from lorac.runtime.engine.graphs import Graphs
    spec = ModelSpec.from_hf_config(dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, tie_word_embeddings=True))
    train = TrainSpec(batch=2, seq=16, rank=2, alpha=4.0, lora_targets=("q_proj", "v_proj"), packing=packing,
                      loss_chunk=8)
    shapes = Graphs(spec, train, "cpu", "float32", ".", None, lambda m: None).shapes
    for build in (build_training_graph, build_eval_graph):
        found = _int64_math(flat_lora_io(build(spec, train), shapes))
        assert found == {("Cast", "data"), ("Gather", "indices")}, found
    assert np.iinfo(np.int32).max > spec.vocab


class _Value:
    def __init__(self, shape, how):
        self.shape_, self.how = list(shape), how


class _AllocOrt:
    """onnxruntime as far as DeviceValues allocates: memory-info allocation that works or fails."""

    class OrtDeviceMemoryType:
        DEFAULT = "default"

    def __init__(self, fail: bool):
        ort = self

        class OrtValue:
            @staticmethod
            def ortvalue_from_shape_and_type(shape, dtype, memory_info=None):
                if ort.fail:
                    raise RuntimeError("no allocator for that memory info")
                return _Value(shape, f"info:{memory_info}")
        self.OrtValue, self.fail = OrtValue, fail

    copy_tensors = None


def test_device_values_allocate_from_the_memory_info_else_a_session():
    from lorac.runtime.engine.ort import DeviceValues

    class Session:
        made = 0

        def __init__(self):
            Session.made += 1

        def create_ortvalue_from_shape_and_type(self, shape, dtype, device, device_id):
            return _Value(shape, f"session:{device}:{device_id}")
    entry = SimpleNamespace(memory_info=lambda kind: f"webgpu-{kind}")
    good = DeviceValues(_AllocOrt(fail=False), entry, session=Session)
    assert good.empty((3,)).how == "info:webgpu-default" and good.how == "the device entry's memory info"
    bad = DeviceValues(_AllocOrt(fail=True), entry, session=Session)
    assert [bad.empty((2,)).how, bad.empty((4,)).how] == ["session:webgpu:0"] * 2 and Session.made == 1
    assert bad.how.startswith("a session's allocator (the memory info's failed: no allocator")
    none = DeviceValues(_AllocOrt(fail=False), SimpleNamespace(memory_info=lambda kind: None), session=Session)
    assert none.empty((1,)).how == "session:webgpu:0" and none.how == "a session's allocator"
    late = DeviceValues(_AllocOrt(fail=False), entry, session=Session)
    late.empty((1,))
    late.ort.fail = True  # a later failure (out of memory) is not a reason to switch allocators
    with pytest.raises(RuntimeError, match="no allocator"):
        late.empty((1,))
    with pytest.raises(LoracError, match="declares no memory"):
        DeviceValues(_AllocOrt(fail=False), SimpleNamespace(memory_info=lambda kind: None)).empty((1,))
