"""Checkpoints: exact round trip, clear errors, and kill -9 during a write (subprocess)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from lorac.runtime.train.checkpoint import FORMAT, config_hash, load_checkpoint, rng_from_state, rng_state, save_checkpoint
from lorac.runtime.errors import LoracError
from lorac.core.integrity import seal

NAME = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


def tensors(step):
    rng = np.random.default_rng(step)
    lora = {NAME.format("A"): rng.standard_normal((4, 16), dtype=np.float32),
            NAME.format("B"): rng.standard_normal((16, 4), dtype=np.float32)}
    m = {k: x * 0.1 for k, x in lora.items()}
    v = {k: x * x for k, x in lora.items()}
    return lora, m, v


def test_round_trip_is_exact_and_rng_resumes(tmp_path):
    rng = np.random.default_rng(123)
    rng.random(7)
    lora, m, v = tensors(5)
    state = {"rng": rng_state(rng), "data": {"epoch": 1, "index": 42}, "train_config": {"lr": 1e-4},
             "model_hash": config_hash({"hidden_size": 64}), "graph_hash": "abc"}
    d = save_checkpoint(tmp_path, 5, lora, m, v, state)
    expected_next = rng.random(5)
    ck = load_checkpoint(tmp_path, model_hash=config_hash({"hidden_size": 64}), graph_hash="abc")
    assert ck.path == d and ck.step == 5
    assert ck.state["data"] == {"epoch": 1, "index": 42} and ck.state["lorac_version"]
    for k in lora:
        assert np.array_equal(ck.lora[k], lora[k]) and np.array_equal(ck.m[k], m[k]) and np.array_equal(ck.v[k], v[k])
    assert np.array_equal(rng_from_state(ck.state["rng"]).random(5), expected_next)
    json.dumps(ck.state)  # plain JSON all the way


def test_latest_moves_and_old_ones_are_pruned(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, *tensors(step), keep=2)
    assert load_checkpoint(tmp_path).step == 40
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == ["ckpt-000030", "ckpt-000040"]
    d = save_checkpoint(tmp_path, 40, *tensors(41), keep=2)  # same step again: a fresh name
    assert d.name == "ckpt-000040.1" and load_checkpoint(tmp_path).path == d
    assert load_checkpoint(tmp_path / "ckpt-000040").step == 40  # keep=2: 30 was pruned
    assert not (tmp_path / "ckpt-000030").exists()


def _refused(match: str, path, **kw) -> None:
    """load_checkpoint(path) fails with LoracError matching `match`, in one line."""
    with pytest.raises(LoracError, match=match) as err:
        load_checkpoint(path, **kw)
    assert "\n" not in str(err.value), str(err.value)


def test_clear_errors(tmp_path):
    _refused("checkpoint not found", tmp_path / "nope")
    _refused("not a lorac checkpoint", tmp_path)
    d = save_checkpoint(tmp_path / "a", 1, *tensors(1), model_hash="1" * 64, graph_hash="g")
    _refused("another model", d, model_hash="2" * 64)
    _refused("another training graph", d, graph_hash="x")
    blob = bytearray((d / "optim.safetensors").read_bytes())
    blob[-3] ^= 0xFF
    (d / "optim.safetensors").write_bytes(bytes(blob))
    _refused("corrupt checkpoint .*optim.safetensors", d)
    (d / "state.json").write_text("{not json")
    _refused("state.json unreadable", d)
    (d / "lora.safetensors").unlink()
    files = {"lora.safetensors": "0", "optim.safetensors": "0"}
    (d / "state.json").write_text(json.dumps(seal({"format": FORMAT, "step": 1, "files": files}, "state_sha256")))
    _refused("lora.safetensors is missing", d)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "latest").write_text("ckpt-000009\n")
    _refused("not a checkpoint", tmp_path / "b")
    (tmp_path / "c").mkdir()  # a name with a line break in it still makes a one-line message
    (tmp_path / "c" / "latest").write_text("ckpt\n2\n")
    _refused("", tmp_path / "c")


# The child saves step 1, then step 2 with every I/O phase announced on stdout and slowed
# down; the parent kills it with SIGKILL right after the k-th announcement.
CHILD = textwrap.dedent("""
    import sys, time
    from lorac.runtime.train import checkpoint as ck
    sys.path.insert(0, {tests!r})
    from test_checkpoint import tensors
    root = sys.argv[1]
    ck.save_checkpoint(root, 1, *tensors(1))
    def slow(name, fn):
        def wrapped(*a, **k):
            print("PHASE", name, flush=True)
            time.sleep(0.03)
            return fn(*a, **k)
        return wrapped
    for name in ("save_file", "_fsync_file", "_fsync_dir", "_write_text_atomic", "_sha256", "_prune"):
        setattr(ck, name, slow(name, getattr(ck, name)))
    ck.os.rename = slow("rename", ck.os.rename)
    ck.save_checkpoint(root, 2, *tensors(2))
    print("DONE", flush=True)
""")


def _run_child(root: Path, kill_at: int | None) -> list[str]:
    code = CHILD.format(tests=str(Path(__file__).parent))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, text=True, env=env)
    return _kill_when(proc, lambda seen: kill_at is not None and seen[-1].startswith("PHASE")
                      and sum(s.startswith("PHASE") for s in seen) > kill_at)


def _kill_when(proc, should) -> list[str]:
    """Read the child's lines; SIGKILL it as soon as should(lines so far) holds."""
    seen = []
    for line in proc.stdout:
        seen.append(line.strip())
        if should(seen):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=30)
    proc.stdout.close()
    return seen


def test_kill_minus_9_during_write_leaves_previous_checkpoint(tmp_path):
    full = _run_child(tmp_path / "full", None)
    assert full[-1] == "DONE"
    phases = [s for s in full if s.startswith("PHASE")]
    latest_at = phases.index("PHASE _write_text_atomic")
    for k in range(len(phases)):
        root = tmp_path / f"k{k}"
        _run_child(root, k)
        ck = load_checkpoint(root)
        # killed before `latest` was replaced -> the old checkpoint, else the new one; never a mix
        want = 1 if k <= latest_at else 2
        assert ck.step == want, (k, phases[k])
        lora, m, v = tensors(want)
        assert all(np.array_equal(ck.lora[n], lora[n]) and np.array_equal(ck.v[n], v[n]) for n in lora)
        # and the run can carry on writing checkpoints in the same root
        save_checkpoint(root, 3, *tensors(3))
        assert load_checkpoint(root).step == 3
        assert not any(p.name.startswith(".tmp-") for p in root.iterdir())


def _edit_state(d: Path, edit) -> None:
    state = json.loads((d / "state.json").read_text())
    edit(state)
    (d / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize("edit", [
    lambda s: s.update(step=s["step"] + 1),          # a step moved by hand
    lambda s: s.pop("files"),                        # tensor checks turned off
    lambda s: s.update(rgn=s.pop("rng")),            # a flipped key
])
def test_any_edit_of_state_json_is_refused(tmp_path, edit):
    rng = np.random.default_rng(0)
    d = save_checkpoint(tmp_path, 7, *tensors(7), {"rng": rng_state(rng)})
    _edit_state(d, edit)
    with pytest.raises(LoracError, match="state.json does not match its checksum") as e:
        load_checkpoint(d)
    assert "\n" not in str(e.value)


def test_a_resealed_state_is_still_checked_field_by_field(tmp_path):
    d = save_checkpoint(tmp_path, 7, *tensors(7), {"rng": {"bit_generator": "seed", "state": {}}})
    with pytest.raises(LoracError, match="bit generator 'seed'"):  # looked up by name on np.random before
        rng_from_state(load_checkpoint(d).state["rng"])
    _edit_state(d, lambda s: (s.pop("files"), s.update(seal(s, "state_sha256"))))
    with pytest.raises(LoracError, match="does not record the checksums"):
        load_checkpoint(d)


def test_pruning_goes_by_step_and_counts_only_complete_checkpoints(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, *tensors(step), keep=5)
    # what a kill in the middle of deleting ckpt-10 left (its mtime is now the newest)
    (tmp_path / "ckpt-000010" / "lora.safetensors").unlink()
    os.utime(tmp_path / "ckpt-000010")
    save_checkpoint(tmp_path, 40, *tensors(40), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name == "latest") == ["ckpt-000030", "ckpt-000040"]
    assert load_checkpoint(tmp_path / "ckpt-000030").step == 30


PRUNE_CHILD = textwrap.dedent("""
    import os, sys, time
    from lorac.runtime.train import checkpoint as ck
    sys.path.insert(0, {tests!r})
    from test_checkpoint import tensors
    root = sys.argv[1]
    for step in (1, 2):
        ck.save_checkpoint(root, step, *tensors(step), keep=2)
    unlink = os.unlink
    def slow_unlink(*a, **k):
        print("UNLINK", flush=True)
        time.sleep(0.2)
        return unlink(*a, **k)
    os.unlink = slow_unlink
    ck.save_checkpoint(root, 3, *tensors(3), keep=2)   # prunes ckpt-1, file by file
    print("DONE", flush=True)
""")


def test_kill_while_pruning_leaves_only_whole_checkpoints(tmp_path):
    code = PRUNE_CHILD.format(tests=str(Path(__file__).parent))
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    _kill_when(proc, lambda seen: seen[-1] == "UNLINK")
    assert load_checkpoint(tmp_path).step == 3 and load_checkpoint(tmp_path / "ckpt-000002").step == 2
    assert not (tmp_path / "ckpt-000001").exists()  # gone whole (renamed away), never half
    for step in (4, 5):  # later saves keep the newest two by step and sweep the trash
        save_checkpoint(tmp_path, step, *tensors(step), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000004", "ckpt-000005", "latest"]


DISK_FULL_CHILD = textwrap.dedent("""
    import resource, signal, sys
    import numpy as np
    from lorac.runtime.train import checkpoint as ck
    from lorac.runtime.errors import LoracError
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    big = {name.format("A"): np.ones((64, 512), np.float32), name.format("B"): np.ones((512, 64), np.float32)}
    ck.save_checkpoint(sys.argv[1], 1, big, big, big)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)              # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))  # as on a full disk
    try:
        ck.save_checkpoint(sys.argv[1], 2, big, big, big)
    except LoracError as e:
        print("ERROR", e)
""")


def test_disk_full_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    r = subprocess.run([sys.executable, "-c", DISK_FULL_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.startswith("ERROR cannot write checkpoint") and r.stdout.count("\n") == 1, r.stdout
    assert load_checkpoint(tmp_path).step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001", "latest"]


# a state.json's train_config as lorac wrote it before TrainConfig.targets became lora_targets,
# when checkpointing was a switch and before packing, keep_layers, memory_budget and tune existed
OLD_TRAIN_CONFIG = {
    "model": None, "data": "corpus.txt", "eval_data": None, "out": "lorac-out", "steps": 40, "batch": 2, "seq": 32,
    "rank": 4, "alpha": 8.0, "rslora": False, "targets": ["q_proj", "v_proj"], "trained_layers": "1:2",
    "lr": 0.0002, "loraplus_ratio": 16.0, "warmup": 4, "weight_decay": 0.0, "max_grad_norm": 1.0, "grad_accum": 1,
    "target": "cpu", "dtype": None, "backend": "tvm", "ort_providers": None, "checkpointing": True, "loss_chunk": 0,
    "scan_chunk": 0, "eval_every": 10, "eval_batches": 4, "save_every": 20, "keep_checkpoints": 2, "seed": 0,
    "resume": None, "adapter": None, "cache_dir": ".lorac-cache", "eval_fraction": 0.05, "sample_prompt": None,
    "sample_tokens": 32, "compile_only": False, "no_cuda_graph": False, "progress": "auto", "report_to": "none",
    "gpus": 0, "dist_timeout": 600.0, "extra": {}}


def test_a_checkpoint_of_an_older_lorac_still_loads(tmp_path, capsys):
    """SavedRun reads the older spellings (targets, checkpointing true/false, no packing or
    keep_layers), and the commands that take a checkpoint's settings still take them."""
    from lorac.graphs import ModelSpec, lora_tensor_names
    from lorac.runtime.cli import main
    from lorac.runtime.model.weights import read_config
    from lorac.runtime.train.plan import plan_graphs
    from lorac.runtime.train.saved import SavedRun
    from tiny_model import make_model_dir

    model = make_model_dir(tmp_path / "model")
    config = read_config(model)
    saved_state = {"train_config": dict(OLD_TRAIN_CONFIG, model=str(model)), "model_config": config,
                   "schedule_steps": 40, "data_sha256": "ab" * 32, "updates": 7, "skipped": 0}
    spec = ModelSpec.from_hf_config(config)
    from lorac.runtime.config import TrainConfig
    train = TrainConfig(rank=4, lora_targets=("q_proj", "v_proj"), trained_layers="1:2").train_spec(spec)
    rng = np.random.default_rng(0)
    shape = lambda n: (4, spec.proj_shape(n.split(".")[-3])[1]) if ".lora_A." in n else (spec.proj_shape(n.split(".")[-3])[0], 4)
    lora = {n: rng.standard_normal(shape(n)).astype(np.float32) for n in lora_tensor_names(spec, train)}
    ck = save_checkpoint(tmp_path / "ck", 7, lora, lora, lora, saved_state)

    saved = SavedRun.read(tmp_path / "ck")
    assert (saved.path, saved.step, saved.model, saved.batch, saved.seq, saved.rank, saved.alpha) == \
        (ck, 7, str(model), 2, 32, 4, 8.0)
    assert (saved.lora_targets, saved.trained_layers, saved.checkpointing, saved.keep_layers, saved.packing) == \
        (("q_proj", "v_proj"), "1:2", "on", 0, None)
    assert saved.optimizer == {"lr": 0.0002, "loraplus_ratio": 16.0, "warmup": 4, "weight_decay": 0.0,
                               "max_grad_norm": 1.0}
    assert (saved.schedule_steps, saved.data_sha256, saved.model_config) == (40, "ab" * 32, config)
    # eval/generate's graphs from it: its adapter, no recompute
    plan = plan_graphs(saved.config(TrainConfig(batch=1, rank=1, alpha=1.0)), spec)
    assert (plan.train.lora_targets, plan.train.rank, plan.train.alpha, tuple(plan.train.trained_layers)) == \
        (("q_proj", "v_proj"), 4, 8.0, (1,))
    assert (plan.train.batch, plan.train.seq, plan.train.checkpointing) == (2, 32, False)
    # export reads it
    assert main(["export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "peft")]) == 0
    adapter = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], sorted(adapter["target_modules"])) == (4, 8.0, ["q_proj", "v_proj"])
    assert main(["export", "--format", "onnx", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "g.onnx")]) == 0
    assert "exported the train graph (2x32, rank 4)" in capsys.readouterr().out
