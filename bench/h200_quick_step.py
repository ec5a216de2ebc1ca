"""Time a few steps of one artifact on a GPU machine (runtime-only TVM; no torch).
Usage: h200_quick_step.py ART_DIR [STEPS]  (inputs: bench/h200_check.make_inputs, tiled).
Also prints the GPU memory in use after the steps (TVM's allocator keeps what the step
took, so this is the step's peak plus the inputs) and the manifest's static memory plan."""
import json
import subprocess
import sys
import time
from pathlib import Path

sys.modules["torch"] = None  # the runtime must not need torch
sys.path.insert(0, str(Path(__file__).parent))
from h200_check import device_inputs, time_step  # noqa: E402

from lorac.runtime.engine.artifact import load_artifact  # noqa: E402

art, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
step = load_artifact(art, "cuda")
inputs, args = device_inputs(step)
t = time.perf_counter()
out = step(args)  # warm-up, also the numbers below
warm = time.perf_counter() - t
dt = time_step(step, args, n=steps, warm=0)
tokens = int(inputs["input_ids"].size)
used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                      capture_output=True, text=True, check=False).stdout.strip()
print(json.dumps(dict(artifact=Path(art).name, warm_s=round(warm, 2), step_s=round(dt, 3), tok_s=round(tokens / dt),
                      loss=float(out["loss"]), gpu_mem_used_mib=used, plan=step.manifest.memory)), flush=True)
