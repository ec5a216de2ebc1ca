#!/usr/bin/env bash
# Source on the GPU machine from the repo root (after bench/h200_env.sh, which sets PYTHONPATH
# anew, where lorac's CUDA column is wanted): onnxruntime and its WebGPU plugin from the cp312
# wheels `bench/webgpu_step.py prepare` put in DIR/whl, Debian's Vulkan loader unpacked in
# DIR/vulkan, NVIDIA's Vulkan ICD, and lorac importable from this checkout.
#   source bench/webgpu_env.sh [DIR]      (DIR: .devcarry/webgpu)
D=${1:-.devcarry/webgpu}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_w "$D"/whl/*.whl
# the Vulkan loader and glvnd into the (throwaway) GPU machine's system, as its README advises
if [ -d "$D/debs" ] && [ "$(id -u)" = 0 ]; then for f in "$D"/debs/*.deb; do dpkg -x "$f" /; done; ldconfig; fi
export LD_LIBRARY_PATH=$PWD/$D/vulkan/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
mkdir -p /tmp/shim/lorac
for p in core graphs compiler runtime; do ln -sfn "$PWD/$p" /tmp/shim/lorac/$p; done
cp lorac_pkg/__init__.py /tmp/shim/lorac/
export PYTHONPATH=/tmp/shim:/tmp/site_w${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import onnxruntime as o, onnxruntime_ep_webgpu as w; o.register_execution_provider_library('webgpu', \
w.get_library_path()); print('onnxruntime', o.__version__, [(d.ep_name, d.device.vendor) for d in o.get_ep_devices()])"
