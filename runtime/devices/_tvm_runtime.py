"""Shared by the devices whose TVM runtime no apache-tvm wheel carries (OpenCL, ROCm, Vulkan;
Metal outside macOS): lorac compiles for them, and runs their artifacts only in a TVM
built with that runtime (NOTES.md: on the H200 an opencl artifact failed with
"ffi.Module.load_from_bytes.opencl ... not registered")."""
from __future__ import annotations


def has_runtime(kind: str) -> bool:
    """Whether this process' TVM runtime has device `kind` (its device API is registered)."""
    import tvm  # noqa: F401 - loads libtvm_runtime, which registers its device APIs
    import tvm_ffi
    return tvm_ffi.get_global_func(f"device_api.{kind}", allow_missing=True) is not None


def needs(kind: str, label: str, flag: str, wheels: str = "no apache-tvm wheel has one") -> str | None:
    """unavailable() of such a device: None where this TVM runs it, else the one line."""
    if has_runtime(kind):
        return None
    return f"its artifacts need a TVM runtime built with {label} ({flag}=ON); this TVM has none ({wheels})"


def open_device(kind: str, label: str, flag: str, wheels: str = "no apache-tvm wheel has one"):
    """open() of such a device: its TVM device, or one LoracError line."""
    from ..errors import LoracError
    why = needs(kind, label, flag, wheels)
    if why:
        raise LoracError(f"device {kind}: {why}")
    import tvm
    dev = tvm.device(kind, 0)
    if not dev.exist:
        raise LoracError(f"device {kind} requested but no {label} device is visible")
    return dev


def interface(kind: str, label: str, flag: str, wheels: str = "no apache-tvm wheel has one"):
    """(unavailable, open) of such a device module (the interface in __init__.py)."""
    def unavailable(target: str) -> str | None:
        return needs(kind, label, flag, wheels)

    def open_(art_dir, manifest):
        return open_device(kind, label, flag, wheels)
    return unavailable, open_
