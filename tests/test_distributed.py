"""Data-parallel training on the CPU (issue 14): 2 MPI workers against 1 process, fp32.

The corpus is prompt/completion JSONL with prompts of varied length: only completion tokens
count in the loss, so the workers' halves of a batch count different numbers of tokens and a
plain average of their gradients would be wrong (distributed.shard_rows weights them).

What is equal to what (docs/DISTRIBUTED.md, "How equal"): the all-reduced gradient equals the
one-process gradient of the whole batch to float32 rounding (~5e-7 relative: a batch-2 step
sums its GEMMs in another order than a batch-4 one), and so do the per-step losses; the final
LoRA weights agree to 1e-6 relative as a whole (L2 over the adapter). AdamW divides each
element's step by that element's own gradient scale, so an element whose gradient nearly
cancels carries the rounding into its update at full learning-rate size: single tensors
differ by up to ~1e-6, single elements by ~2e-5 of their tensor's largest value. A plain,
unweighted average of the workers' gradients is off by 13-31 % here.
"""
import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from test_train_e2e import LORAC, _records, _run
from tiny_model import make_model_dir

pytest.importorskip("tvm")
STEPS = 4


def _mpi_missing() -> str | None:
    try:
        from lorac.runtime.dist.launch import find_mpiexec, mpi_library
        mpi_library()
        find_mpiexec()
    except Exception as e:  # noqa: BLE001 - the reason is the skip message
        return str(e)
    return None


needs_mpi = pytest.mark.skipif(_mpi_missing() is not None, reason=f"no MPI here: {_mpi_missing()}")


def _corpus(path: Path, n: int = 160) -> Path:
    words = ["red", "big", "old", "sly", "blue", "flat", "new", "odd"]
    recs = [{"prompt": f"q{i}: " + " ".join(words[(i + k) % 8] for k in range(i % 7)) + "?\n",
             "completion": f"the {words[i % 8]} cat sat on the {words[(i * 3) % 8]} mat."} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _args(d: Path, out: Path, steps: int, *extra) -> list[str]:
    return ["train", "--model", str(d / "model"), "--data", str(d / "corpus.jsonl"), "--out", str(out),
            "--steps", str(steps), "--batch", "4", "--seq", "32", "--lr", "2e-3", "--eval-every", "2",
            "--save-every", "2", "--cache-dir", str(d / "cache"), "--sample-tokens", "0",
            "--targets", "q_proj,v_proj,down_proj", *extra]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    make_model_dir(d / "model")
    _corpus(d / "corpus.jsonl")
    return d


@pytest.fixture(scope="module")
def work(base):
    d = base
    for out, extra in (("ref", ()), ("dp", ("--gpus", "2"))):
        r = _run(_args(d, d / out, STEPS, *extra))
        assert r.returncode == 0, r.stderr[-3000:]
    return d


def _losses(out: Path) -> dict:
    return {(r["step"], "loss" in r): r.get("loss", r.get("eval_loss")) for r in _records(out)}


def _rel(x, y) -> float:
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def _assert_same_run(got: Path, ref: Path, steps) -> None:
    """Per-step train and eval losses and the final LoRA weights (L2 over the adapter) to 1e-6
    relative; each tensor to 1e-5 (module doc)."""
    from lorac.runtime.train.checkpoint import load_checkpoint
    a, b = _losses(got), _losses(ref)
    keys = [k for k in b if k[0] in steps]
    assert keys and all(k in a for k in keys)
    worst = max(abs(a[k] - b[k]) / abs(b[k]) for k in keys)
    assert worst <= 1e-6, worst
    ca, cb = load_checkpoint(got / "checkpoints"), load_checkpoint(ref / "checkpoints")
    assert ca.step == cb.step == STEPS and ca.state["data"] == cb.state["data"]
    flat = lambda d: np.concatenate([d[n].ravel() for n in sorted(d)]).astype(np.float64)  # noqa: E731
    assert _rel(flat(ca.lora), flat(cb.lora)) <= 1e-6
    assert max(_rel(ca.lora[n], cb.lora[n]) for n in cb.lora) <= 1e-5


@needs_mpi
@pytest.mark.slow
def test_two_workers_train_what_one_process_trains(work):
    recs = _records(work / "dp")
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, STEPS + 1))  # rank 0 alone wrote them
    _assert_same_run(work / "dp", work / "ref", range(0, STEPS + 1))
    summary = json.loads((work / "dp" / "summary.json").read_text())
    assert summary["steps"] == STEPS and (work / "dp" / "adapter" / "adapter_model.safetensors").is_file()


@needs_mpi
@pytest.mark.slow
def test_a_two_worker_checkpoint_resumes_in_one_process(work, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(work / "dp", out)
    r = _run(_args(work, out, STEPS, "--resume", str(out / "checkpoints" / "ckpt-000002")))
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same_run(out, work / "ref", range(3, STEPS + 1))
    _assert_same_run(out, work / "dp", range(3, STEPS + 1))  # and the 2-worker run it continues


def _worker(launcher: subprocess.Popen, rank: int, timeout: float = 60):
    import psutil
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if p.environ().get("PMI_RANK") == str(rank) and "python" in p.name():
                    return p
            except psutil.Error:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no worker {rank}")


def _start_and_wait(work: Path, out: Path, *extra) -> subprocess.Popen:
    p = subprocess.Popen(LORAC + _args(work, out, 500, "--gpus", "2", "--eval-every", "1", *extra),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if (out / "checkpoints" / "latest").exists() and sum("loss" in r for r in _records(out)) >= 3:
            return p
        time.sleep(0.05)
    p.kill()
    raise AssertionError(f"the run did not get going: {p.communicate()[1][-3000:]}")


def _one_line(err: str, rc: int, *needles) -> str:
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("lorac: error:") and all(n in last for n in needles), (rc, err[-3000:])
    assert "Traceback" not in err and "BAD TERMINATION" not in err and "MPI_Abort" not in err
    assert sum(ln.startswith("lorac: error:") for ln in err.splitlines()) == 1
    return last


def _resumable(out: Path) -> None:
    from lorac.runtime.train.checkpoint import load_checkpoint
    assert 2 <= load_checkpoint(out / "checkpoints").step < 500  # whole and verified


@needs_mpi
@pytest.mark.slow
def test_a_killed_worker_stops_the_run_with_one_line(work, tmp_path):
    out = tmp_path / "killed"
    p = _start_and_wait(work, out, "--dist-timeout", "20")
    _worker(p, 1).kill()
    t0 = time.time()
    _, err = p.communicate(timeout=60)
    took = time.time() - t0
    assert took < 20, took  # mpiexec stops the others at once; no collective waits out its timeout
    _one_line(err, p.returncode, "worker 1 of 2 died (killed by SIGKILL)", f"--resume {out / 'checkpoints'}")
    _resumable(out)


@needs_mpi
@pytest.mark.slow
def test_a_hung_worker_ends_the_run_at_the_timeout(work, tmp_path):
    out = tmp_path / "hung"
    p = _start_and_wait(work, out, "--dist-timeout", "4")
    victim = _worker(p, 1)
    victim.suspend()  # SIGSTOP: alive, but never joins the next collective
    t0 = time.time()
    try:
        _, err = p.communicate(timeout=60)
    finally:
        if victim.is_running():
            victim.kill()
    assert time.time() - t0 < 4 + 15
    _one_line(err, p.returncode, "did not answer within 4 s (--dist-timeout)", "--resume")
    _resumable(out)


# -- without MPI ------------------------------------------------------------------------------
@pytest.mark.slow
def test_weighted_worker_gradients_sum_to_the_whole_batch_gradient(base):
    """The arithmetic of the all-reduce, in one process: the batch-4 step's loss and LoRA
    gradients against the two batch-2 steps of its halves, weighted by their counted tokens."""
    from lorac.runtime.dist import shard_rows
    from lorac.runtime.config import TrainConfig
    from lorac.runtime.train.run import Run, init_lora
    kw = dict(model=str(base / "model"), data=str(base / "corpus.jsonl"), batch=4, seq=32,
              cache_dir=str(base / "cache"), lora_targets=("q_proj", "v_proj", "down_proj"))
    whole, halves = (Run(TrainConfig(**kw, gpus=g), log=lambda m: None) for g in (0, 2))
    rng = np.random.default_rng(1)
    lora = {n: (rng.normal(0, 0.02, s) if ".lora_B." in n else init_lora({n: s}, rng)[n]).astype(np.float32)
            for n, s in whole.engine.shapes.items()}
    batch = next(whole.data.batches(4, seed=3))
    counts = (batch["labels"][:, 1:] != -100).sum(axis=1)
    assert counts[:2].sum() != counts[2:].sum()  # the halves count differently: weights matter

    def grads(run, b):
        out = run.engine.step(b, lora)
        return out.pop("loss"), run.engine.host(out)
    loss, ref = grads(whole, batch)
    total, got = 0.0, {}
    for r in range(2):
        part, share = shard_rows(batch, r, 2)
        part_loss, g = grads(halves, part)
        total += share * part_loss
        got = {k: got.get(k, 0) + np.float32(share) * v for k, v in g.items()}
    assert abs(total - loss) <= 1e-6 * abs(loss)
    assert max(_rel(got[k], ref[k]) for k in ref) <= 1e-6
    plain = {k: v for k, v in got.items()}  # what an unweighted mean would have given instead
    for r in range(2):
        part, share = shard_rows(batch, r, 2)
        _, g = grads(halves, part)
        plain = {k: plain[k] + (np.float32(0.5) - np.float32(share)) * v for k, v in g.items()}
    assert min(_rel(plain[k], ref[k]) for k in ref) > 1e-2


def test_shards_weigh_their_counted_tokens():
    """Per-worker means weighted by shares sum to the whole batch's mean, with uneven masks."""
    from lorac.runtime.dist import shard_rows
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 50, (8, 16))
    labels[rng.random((8, 16)) < 0.5] = -100
    labels[5] = -100  # a row that counts nothing
    nll = rng.random((8, 16))
    batch = {"input_ids": np.arange(128).reshape(8, 16), "labels": labels}

    def mean(lab, v):
        keep = lab[:, 1:] != -100
        return (v[:, 1:] * keep).sum() / max(keep.sum(), 1)
    for size in (1, 2, 4):
        total, shares = 0.0, []
        for r in range(size):
            part, w = shard_rows(batch, r, size)
            assert np.array_equal(part["input_ids"], batch["input_ids"][r * 8 // size:(r + 1) * 8 // size])
            total += w * mean(part["labels"], nll[r * 8 // size:(r + 1) * 8 // size])
            shares.append(w)
        assert abs(total - mean(labels, nll)) < 1e-12 and abs(sum(shares) - 1) < 1e-12
    none = {"input_ids": batch["input_ids"][:2], "labels": np.full((2, 16), -100)}
    assert shard_rows(none, 1, 2)[1] == 0.0


def test_gpus_without_mpi_or_uneven_batch_is_one_line(tmp_path):
    from lorac.runtime.cli import main
    from lorac.runtime.config import TrainConfig
    from lorac.runtime.errors import LoracError
    with pytest.raises(LoracError, match="split evenly over --gpus 3"):
        TrainConfig(batch=4, gpus=3).validate()
    with pytest.raises(LoracError, match="--dist-timeout"):
        TrainConfig(dist_timeout=0).validate()
    from lorac.runtime import dist as distributed
    if not distributed.under_mpi():
        with pytest.raises(LoracError, match="not started by mpiexec"):
            distributed.setup(TrainConfig(gpus=2))
    assert main(["train", "--gpus", "-1"]) == 2


def test_trl_per_device_batch_counts_per_worker(tmp_path):
    """--batch is the global batch; TRL's --per-device-train-batch-size keeps its meaning."""
    from lorac.runtime.cli import build_parser, train_config
    parse = lambda *a: train_config(build_parser().parse_args(["train", *a]))  # noqa: E731
    assert parse("--batch", "4", "--gpus", "2").batch == 4
    assert parse("--per-device-train-batch-size", "4", "--gpus", "2").batch == 8
    assert parse("--per-device-train-batch-size", "4").batch == 4
    assert parse("--per-device-train-batch-size", "4", "--batch", "6", "--gpus", "2").batch == 6  # the last flag wins
    toml = tmp_path / "run.toml"
    toml.write_text("per_device_train_batch_size = 3\ngpus = 2\n")
    assert parse("--config", str(toml)).batch == 6 and parse("--config", str(toml), "--batch", "4").batch == 4


def test_launcher_turns_mpi_failure_reports_into_one_line(tmp_path):
    """MPICH hydra's banner for a killed worker, as it prints it, becomes one line."""
    import io
    from lorac.runtime.dist.launch import Output, summary_line
    from lorac.runtime.config import TrainConfig
    banner = ["", "=" * 83, "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES", "=   PID 15952 RUNNING AT vm",
              "=   EXIT CODE: 9", "=   CLEANING UP REMAINING PROCESSES", "=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES",
              "=" * 83, "[mpiexec@vm] Exit codes: [vm] 0,9",
              "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)",
              "This typically refers to a problem with your application.",
              "Please see the FAQ page for debugging suggestions", "step 3/9 | loss 4.2"]
    out, shown = Output(), io.StringIO()
    for line in banner:
        out.feed(line + "\n", shown)
    assert shown.getvalue() == "\nstep 3/9 | loss 4.2\n"
    line = summary_line(out, 9, 2, TrainConfig(out=str(tmp_path)))
    assert line == ("lorac: error: worker 1 of 2 died (killed by SIGKILL); mpiexec stopped the others with it. "
                    "No checkpoint was written yet.")
    out = Output()  # an error every worker reports: said once; the abort notice not at all
    for line in ["lorac: error: data.jsonl: not found", "Abort(2) on node 1 (rank 1 in comm 0): application called "
                 "MPI_Abort(MPI_COMM_WORLD, 2) - process 1", "lorac: error: data.jsonl: not found"]:
        out.feed(line + "\n", shown)
    assert summary_line(out, 2, 2, TrainConfig()) == "lorac: error: data.jsonl: not found"
    out = Output()  # Ctrl-C: every worker stopped after a checkpoint; rank 0's summary says so
    out.feed("[mpiexec@vm] Exit codes: [vm] 130,130\n", shown)
    assert summary_line(out, 130, 2, TrainConfig()) is None
    line = summary_line(Output(), 255, 2, TrainConfig(out=str(tmp_path)))  # mpiexec failed, nothing parsed
    assert line.startswith("lorac: error: mpiexec ended with exit status 255")
