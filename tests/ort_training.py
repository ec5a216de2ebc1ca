"""Oracle 3, onnxruntime-training's autodiff, run in a child process.

onnxruntime-training 1.19.2 (its last release) needs onnx 1.16.2, older than lorac's own
onnx (>= 1.18), and installs the module `onnxruntime` over plain onnxruntime. So
scripts/setup.sh installs the pair into a folder of its own (.venv/ort-training-oracle)
and only this child process puts it first on the path. Where the folder could not be
made (its wheels exist for CPython 3.11 on Linux x86-64 only), the test skips, saying so.

The child reads a forward graph whose loss is output 0 (frozen weights as initializers,
trainable ones named), differentiates it with `generate_artifacts`, runs one training
forward/backward and writes the loss and gradients to an .npz file.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

FOLDER = Path(sys.prefix) / "ort-training-oracle"

CHILD = r"""
import os, sys, numpy as np, onnx
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, Module
model_path, feeds_path, out_path, work = sys.argv[1:5]
model = onnx.load(model_path)
os.makedirs(work, exist_ok=True)
trainable = [l for l in open(model_path + ".trainable").read().split() if l]
frozen = [i.name for i in model.graph.initializer if i.name not in trainable]
artifacts.generate_artifacts(model, requires_grad=trainable, frozen_params=frozen, loss=None, artifact_directory=work)
state = CheckpointState.load_checkpoint(work + "/checkpoint")
module = Module(work + "/training_model.onnx", state)
module.train()
feeds = np.load(feeds_path)
loss = module(*[feeds[i.name] for i in model.graph.input])
np.savez(out_path, loss=np.asarray(loss), **{n: state.parameters[n].grad for n in trainable})
"""


def oracle_folder() -> Path:
    if not (FOLDER / "onnxruntime" / "training").is_dir():
        pytest.skip(f"no onnxruntime-training oracle in {FOLDER} (scripts/setup.sh makes it where "
                    "onnxruntime-training 1.19.2 installs: CPython 3.11, Linux x86-64)")
    return FOLDER


def ort_training_grads(model, feeds: dict, trainable: list[str], work: Path) -> tuple[float, dict]:
    """(loss, {name: gradient}) of `model`'s output 0 by onnxruntime-training's autodiff."""
    import onnx
    folder = oracle_folder()
    work.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(work / "model.onnx"))
    (work / "model.onnx.trainable").write_text("\n".join(trainable))
    np.savez(work / "feeds.npz", **feeds)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", CHILD, str(work / "model.onnx"), str(work / "feeds.npz"),
                        str(work / "out.npz"), str(work / "artifacts")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = np.load(work / "out.npz")
    return float(out["loss"]), {n: out[n] for n in trainable}
