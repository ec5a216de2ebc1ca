"""Time a few steps of one artifact on a GPU machine (runtime-only TVM; no torch).
Usage: h200_quick_step.py ART_DIR [STEPS]  (inputs: bench/h200_check.make_inputs, tiled)."""
import json
import sys
import time
from pathlib import Path

sys.modules["torch"] = None  # the runtime must not need torch
sys.path.insert(0, str(Path(__file__).parent))
from h200_check import make_inputs  # noqa: E402

from lorac.runtime.artifact import load_artifact  # noqa: E402

art, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
step = load_artifact(art, "cuda")
inputs = make_inputs(step.manifest, exact=False)
args = {s["name"]: step.upload(s, inputs[s["name"]]) for s in step.inputs}
t = time.perf_counter()
out = step(args)  # warm-up, also the numbers below
warm = time.perf_counter() - t
t = time.perf_counter()
for _ in range(steps):
    step(args, as_numpy=False)
step._dev.sync()
dt = (time.perf_counter() - t) / steps
tokens = int(inputs["input_ids"].size)
print(json.dumps(dict(artifact=Path(art).name, warm_s=round(warm, 2), step_s=round(dt, 3), tok_s=round(tokens / dt),
                      loss=float(out["loss"]))), flush=True)
