"""onnxruntime's WebGPU plugin execution provider (PyPI `onnxruntime-ep-webgpu`, Dawn underneath:
Vulkan on Linux, Metal on macOS, D3D12 on Windows): AMD, Apple, Intel and NVIDIA GPUs through
one pip package (`pip install 'lorac[webgpu]'`).

    ep_device, adapter = open_device(onnxruntime)   # registered, chosen; one LoracError line if not
    so.add_provider_for_devices([ep_device], {})     # a session on it (engine/ort.py)

As the plugin's README shows: register its library with onnxruntime (>= 1.24.4), take the
`WebGpuExecutionProvider` entry of `get_ep_devices()` (the EP accepts one device entry and
picks the physical GPU itself), and add it to the session options. `adapter` describes what
ran, for the run's summary: vendor, PCI ids, the entry's metadata and the graphics API Dawn
uses on this OS.
"""
from __future__ import annotations

import os
import platform

from ..errors import LoracError

EP = "WebGpuExecutionProvider"
PLUGINS = (EP,)  # execution providers lorac registers from a plugin library (not in get_available_providers)
MIN_ORT = (1, 24, 4)
INSTALL = "pip install 'lorac[webgpu]'"
BACKENDS = {"Linux": "Vulkan", "Darwin": "Metal", "Windows": "D3D12"}  # what Dawn runs on, per OS
_registered: set = set()  # ids of the onnxruntime modules the library is registered with

# The plugin's provider options that bear on training (keys its 0.4.0 library reads, each as the
# session entry "ep.webgpuexecutionprovider.<key>"; onnxruntime's webgpu_provider_options.h; not
# the KV-cache ones, nor the handles of a caller's own Dawn instance or device) -> the values it
# accepts (None: a number or a name). Its defaults: validationMode basic, storage buffers cached
# in buckets, uniform ones simply, maxNumPendingDispatches 16 (one queue submit per 16 kernels),
# no graph capture, int64 kernels off (int64 nodes run on the CPU).
_ON_OFF = ("0", "1")
_CACHE = ("disabled", "lazyRelease", "simple", "bucket")
OPTIONS = {
    "validationMode": ("disabled", "wgpuOnly", "basic", "full"), "storageBufferCacheMode": _CACHE,
    "uniformBufferCacheMode": _CACHE, "queryResolveBufferCacheMode": _CACHE, "defaultBufferCacheMode": _CACHE,
    "maxNumPendingDispatches": None, "enableInt64": _ON_OFF, "enableGraphCapture": _ON_OFF,
    "enableRobustness": _ON_OFF, "preserveDevice": _ON_OFF, "enablePIXCapture": _ON_OFF,
    "preferredLayout": ("NCHW", "NHWC"), "dawnBackendType": ("D3D12", "Vulkan"),
    "powerPreference": ("high-performance", "low-power"), "maxStorageBufferBindingSize": None,
    "sessionBufferPoolGenerations": None, "forceCpuNodeNames": None, "deviceId": None,
}
# What lorac passes to the plugin where LORAC_ORT_EP_OPTIONS does not set the key, and the
# SessionOptions attributes it sets on a WebGPU session (e.g. {"graph_optimization_level":
# "ORT_ENABLE_EXTENDED", "enable_mem_pattern": False}): the plugin's and onnxruntime's own
# defaults until a GPU measurement (bench/webgpu_profile.py) shows a setting faster and exact.
DEFAULTS: dict[str, str] = {}
SESSION: dict = {}


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("+")[0].split("."):
        digits = "".join(c for c in p if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if digits != p:
            break
    return tuple(parts)


def register(ort) -> None:
    """Register the plugin's library with `ort` once; one LoracError line when the plugin is
    missing or this onnxruntime is too old for it."""
    if id(ort) in _registered:
        return
    if _version(ort.__version__) < MIN_ORT:
        raise LoracError(f"--target webgpu needs onnxruntime >= {'.'.join(map(str, MIN_ORT))} for its WebGPU plugin, "
                         f"and this one is {ort.__version__}: {INSTALL} (or pip install --upgrade onnxruntime)")
    if not hasattr(ort, "register_execution_provider_library"):
        raise LoracError(f"--target webgpu: this onnxruntime ({ort.__version__}) cannot load plugin execution "
                         f"providers: {INSTALL}")
    try:
        import onnxruntime_ep_webgpu as plugin
    except ImportError:
        raise LoracError(f"--target webgpu needs onnxruntime's WebGPU plugin (onnxruntime-ep-webgpu): {INSTALL}") \
            from None
    try:
        ort.register_execution_provider_library("webgpu", plugin.get_library_path())
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own Fail/RuntimeError kinds
        if "already registered" not in str(e):
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise LoracError(f"--target webgpu: onnxruntime {ort.__version__} refused the WebGPU plugin "
                             f"({first}); {INSTALL} installs a matching pair") from None
    _registered.add(id(ort))


def choose(ep_devices) -> object | None:
    """The WebGPU EP's device entry among `ep_devices` (onnxruntime's get_ep_devices()), or
    None: a GPU-typed entry first (the EP takes one entry and picks the physical GPU itself)."""
    entries = [d for d in ep_devices if d.ep_name == EP]
    gpus = [d for d in entries if str(getattr(d.device, "type", "")).rsplit(".", 1)[-1] == "GPU"]
    return (gpus or entries or [None])[0]


def _vulkan_loader() -> bool:
    """Whether the Vulkan loader (libvulkan.so.1) loads in this process."""
    import ctypes
    try:
        ctypes.CDLL("libvulkan.so.1")
        return True
    except OSError:
        return False


def no_adapter(system: str | None = None, vulkan_loader: bool | None = None) -> str:
    """Why no WebGPU adapter was found, with what to do, in one line."""
    system = system or platform.system()
    head = "--target webgpu: onnxruntime's WebGPU plugin found no GPU adapter"
    if system == "Linux":
        if not (_vulkan_loader() if vulkan_loader is None else vulkan_loader):
            return (f"{head}: it runs on Vulkan, and the Vulkan loader libvulkan.so.1 is not installed (Debian/Ubuntu: "
                    "apt install libvulkan1; Fedora: dnf install vulkan-loader; without root: unpack Debian's "
                    "libvulkan1 .deb with dpkg -x and put its usr/lib/<arch> folder on LD_LIBRARY_PATH)")
        return (f"{head}: the Vulkan loader (libvulkan.so.1) is there but offers no GPU: install the GPU's Vulkan "
                "driver (AMD/Intel: mesa-vulkan-drivers; NVIDIA: the driver's Vulkan ICD, or point VK_DRIVER_FILES "
                "at its nvidia_icd.json); `vulkaninfo --summary` lists what Vulkan sees")
    if system == "Darwin":
        return f"{head}: it runs on Metal, and this Mac offers no Metal GPU to it"
    if system == "Windows":
        return f"{head}: it runs on D3D12: install or update the GPU's driver"
    return f"{head} on {system}"


def describe(ep_device, options: dict | None = None) -> dict:
    """What ran, for the summary: the EP device entry's vendor, ids and metadata, and the
    graphics API: the EP's dawnBackendType option where it is given (LORAC_ORT_EP_OPTIONS),
    else the one Dawn uses on this OS (the entry does not name it)."""
    hw = ep_device.device
    chosen = (options or {}).get("dawnBackendType")
    info = {"execution_provider": EP, "vendor": getattr(hw, "vendor", None),
            "vendor_id": f"0x{int(getattr(hw, 'vendor_id', 0)):04x}",
            "device_id": f"0x{int(getattr(hw, 'device_id', 0)):04x}",
            "type": str(getattr(hw, "type", "")).rsplit(".", 1)[-1],
            "graphics_api": chosen or BACKENDS.get(platform.system(), platform.system()),
            "graphics_api_from": "the dawnBackendType option" if chosen else f"{platform.system()}'s default"}
    meta = dict(getattr(hw, "metadata", None) or {})
    meta.update({f"ep.{k}": v for k, v in (getattr(ep_device, "ep_metadata", None) or {}).items()})
    if meta:
        info["metadata"] = meta
    return info


def open_device(ort, options: dict | None = None) -> tuple[object, dict]:
    """(the WebGPU EP device entry, its description): the plugin registered with `ort` and its
    device chosen; one LoracError line when either cannot be done. `options`: the EP's."""
    register(ort)
    dev = choose(ort.get_ep_devices())
    if dev is None:
        raise LoracError(no_adapter())
    return dev, describe(dev, options)


def check() -> None:
    """One LoracError line, before anything loads, when `--target webgpu` cannot run here."""
    try:
        import onnxruntime
    except ImportError:
        raise LoracError(f"--target webgpu needs onnxruntime and its WebGPU plugin: {INSTALL}") from None
    open_device(onnxruntime, options())


def options(text: str | None = None) -> dict[str, str]:
    """The plugin's provider options: DEFAULTS, then LORAC_ORT_EP_OPTIONS ("key=value;key=value",
    or `text`); one LoracError line for a key or value the plugin does not read (it would ignore
    a misspelt key) and for graph capture, which lorac's step cannot use (it binds the batch from
    the host and swaps the LoRA/AdamW buffers after each update: a captured graph would replay
    the first step's bindings)."""
    text = os.environ.get("LORAC_ORT_EP_OPTIONS", "") if text is None else text
    out = dict(DEFAULTS)
    for item in filter(str.strip, text.split(";")):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq:
            raise LoracError(f"LORAC_ORT_EP_OPTIONS: {item.strip()!r} is not key=value")
        if key not in OPTIONS:
            raise LoracError(f"LORAC_ORT_EP_OPTIONS: {key!r} is not one of the WebGPU plugin's options lorac passes: "
                             f"{', '.join(OPTIONS)}")
        allowed = OPTIONS[key]
        if (allowed and value not in allowed) or (allowed is None and not value):
            raise LoracError(f"LORAC_ORT_EP_OPTIONS: {key}={value!r}: the WebGPU plugin takes "
                             f"{' | '.join(allowed) if allowed else 'a value'}")
        if key == "enableGraphCapture" and value == "1":
            raise LoracError("LORAC_ORT_EP_OPTIONS: enableGraphCapture=1 is not supported: lorac's step binds the "
                             "batch from the host and swaps the LoRA/AdamW buffers each update, which a captured "
                             "graph would not see")
        out[key] = value
    return out


def configure(so, ort) -> None:
    """SESSION's attributes on the SessionOptions `so` of a WebGPU session (the graph
    optimization level by its onnxruntime.GraphOptimizationLevel name)."""
    for name, value in SESSION.items():
        setattr(so, name, getattr(ort.GraphOptimizationLevel, value) if name == "graph_optimization_level" else value)
