"""The CPU standing in for a WebGPU adapter (no GPU here): onnxruntime's WebGPU plugin is
registered for real where it is installed (runtime/engine/ort_webgpu.register), then the CPU
execution provider's device entry takes the WebGPU entry's place and a numpy copy takes the
plugin's data transfer (onnxruntime.copy_tensors), so every line of `lorac train --target
webgpu`'s device-resident path runs (runtime/engine/ort.py DeviceValues). Used by
tests/test_backend_ort_webgpu.py and `bench/webgpu_check.py device --stand-in`.

    import webgpu_stand_in
    webgpu_stand_in.install()                         # this process
    webgpu_stand_in.install(monkeypatch.setattr)      # a test: undone after it
"""
from __future__ import annotations

import numpy as np

ADAPTER = {"execution_provider": "WebGpuExecutionProvider", "vendor": "stand-in", "vendor_id": "0x0000",
           "device_id": "0x0000", "type": "CPU", "graphics_api": "none (the CPU standing in)"}


def _values_class():
    from lorac.runtime.engine.ort import DeviceValues

    class StandInValues(DeviceValues):
        """DeviceValues over CPU memory (the CPU entry declares no memory info; the CPU's
        allocator stands in), copies through numpy. Logs every put and read (`log`)."""
        log: list = []

        def __init__(self, ort_module, ep_device, session=None):
            super().__init__(ort_module, ep_device, session=session, copy=self._copy)
            self.copies = 0

        def empty(self, shape, dtype=np.float32):
            return self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype)

        def _copy(self, src, dst):
            self.copies += 1
            for s, d in zip(src, dst, strict=True):
                d.update_inplace(s.numpy())

        def put(self, arrays):
            StandInValues.log.append(("put", len(arrays)))
            return super().put(arrays)

        def read(self, values):
            StandInValues.log.append(("read", len(values)))
            return super().read(values)
    return StandInValues


def install(setattr=setattr):  # noqa: A002 - pytest's monkeypatch.setattr has the builtin's signature
    """Make `--target webgpu` run on the CPU in this process -> the DeviceValues class in use
    (its `log` lists every put and read). The plugin's library is registered first where it is
    installed (the registration code path as far as it goes without an adapter)."""
    import onnxruntime

    from lorac.runtime.engine import ort as engine_ort
    from lorac.runtime.engine import ort_webgpu
    register = ort_webgpu.register
    cpu = next(d for d in onnxruntime.get_ep_devices() if d.ep_name == "CPUExecutionProvider")

    def open_device(ort_module, options=None):
        try:
            register(ort_module)
        except Exception:  # noqa: BLE001 - no plugin here: the stand-in needs none
            pass
        return cpu, dict(ADAPTER)
    values = _values_class()
    values.log = []
    setattr(ort_webgpu, "open_device", open_device)
    setattr(engine_ort, "DeviceValues", values)
    return values
