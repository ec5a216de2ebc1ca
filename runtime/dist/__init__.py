"""Data-parallel training: the workers of one run, wired by MPI (docs/DISTRIBUTED.md).

Every worker runs the same compiled artifact on its share of each global batch:

- the global batch (`--batch` rows per micro-batch) is drawn by every worker from the same
  data iterator; worker r takes rows [r*B/N, (r+1)*B/N) (`shard`). The data position in a
  checkpoint is therefore the global one, whatever the number of workers;
- a worker's loss is the mean over *its* counted tokens, so its gradient is weighted by its
  share of the batch's counted tokens, n_r / n (known to every worker: all hold the whole
  batch's labels), and the weighted gradients are summed: exactly the gradient of the mean
  over the whole batch, also when padding or masked prompts give the workers different counts;
- only the LoRA gradients cross the wire during training, one all-reduce per flat gradient
  group (graphs/optimizer.Bucket): NCCL on GPUs (runtime/dist/nccl.py), MPI on the CPU. A step
  also exchanges 16 bytes per worker (its weighted loss and whether a signal asked it to stop);
- every worker then runs the same optimizer on the same reduced gradient, so LoRA weights and
  AdamW moments stay identical (compared by checksum at every checkpoint); rank 0 alone writes
  metrics, checkpoints and exports and reads a --resume checkpoint, whose state it broadcasts.

Every collective is non-blocking and waited for with a deadline (`--dist-timeout`): a worker
that hangs ends the run with one line instead of a hang. A worker that dies is the launcher's
to notice: MPI's mpiexec tears the whole job down at once (runtime/dist/launch.py turns that into
one line). `Single` is the one-process case, the same interface doing nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import LoracError

IGNORE = -100
# what an MPI launcher puts in each process's environment (MPICH/Intel MPI hydra, Open MPI, PMIx)
LAUNCHER_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def under_mpi() -> bool:
    """Whether an MPI launcher (mpiexec, srun with PMI) started this process."""
    return any(k in os.environ for k in LAUNCHER_ENV)


def requested_workers(gpus) -> int:
    """Workers the run will have: --gpus N, else the MPI job's size, else 1 (for TRL's
    --per-device-train-batch-size, which counts rows per worker)."""
    if isinstance(gpus, int) and gpus > 1:
        return gpus
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(key, "").isdigit():
            return max(int(os.environ[key]), 1)
    return 1


def counted_tokens(labels: np.ndarray) -> np.ndarray:
    """Tokens each row contributes to the loss (graphs/ops/loss.py: labels shift by one, -100 is ignored)."""
    return (labels[:, 1:] != IGNORE).sum(axis=1)


def shard_rows(batch: dict, rank: int, size: int) -> tuple[dict, float]:
    """Worker `rank`'s rows of a global batch, and its share n_r / n of the batch's counted tokens
    (0 when the batch counts none: the graph then gives loss 0 and zero gradients)."""
    rows = batch["labels"].shape[0]
    if rows % size:
        raise LoracError(f"a batch of {rows} rows does not split over {size} workers")
    per = rows // size
    lo = rank * per
    counted = counted_tokens(batch["labels"])
    total = int(counted.sum())
    share = int(counted[lo:lo + per].sum()) / total if total else 0.0
    return {k: np.ascontiguousarray(v[lo:lo + per]) for k, v in batch.items()}, share


class Single:
    """One process: no one to talk to."""
    size, rank, main, done = 1, 0, True, False
    grad_reducer = None

    def shard(self, batch):
        return batch, 1.0

    def agree(self, loss: float, signal):
        return loss, signal

    def total(self, values):
        return values

    def share_state(self, run, make):
        return make()

    def check_identity(self, run) -> None:
        pass

    def check_same(self, engine, step: int) -> None:
        pass

    def attach(self, engine) -> None:
        pass


_world = Single()


def current():
    return _world


def setup(cfg):
    """The run's workers: Single, or an MPI world when an MPI launcher started this process."""
    global _world
    if isinstance(_world, Mpi):
        return _world
    if not under_mpi():
        if cfg.gpus > 1:
            raise LoracError(f"--gpus {cfg.gpus}: this process was not started by mpiexec "
                             "(run `lorac train --gpus N` to launch the workers)")
        return _world
    world = Mpi(cfg.dist_timeout, cfg.out)
    # (every worker finds these and says so; `lorac train --gpus N` shows the line once)
    if cfg.gpus and cfg.gpus != world.size:
        raise LoracError(f"--gpus {cfg.gpus}, but mpiexec started {world.size} workers; give -n {cfg.gpus} or drop --gpus")
    if cfg.batch % world.size:
        raise LoracError(f"--batch {cfg.batch} (the global batch) does not split evenly over {world.size} workers")
    from .. import devices
    device = devices.for_target(cfg.target)
    if device.DEVICE_PER_WORKER:
        world.pick_device(device)
    _world = world
    return world


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError:
        raise LoracError("this process was started by an MPI launcher, but mpi4py is not installed: "
                         "pip install 'lorac[distributed]'") from None
    return MPI


class Mpi:
    """The workers of an MPI job (COMM_WORLD); every collective waits at most `timeout` s."""
    main = done = False  # done: the run ended on every worker alike (train.train)

    def __init__(self, timeout: float, out="."):
        self.MPI = MPI = _import_mpi()
        self.comm = MPI.COMM_WORLD
        self.size, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        self.main = self.rank == 0
        self.timeout, self.out = float(timeout), out
        self.local_rank = self.comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        self.grad_reducer = None

    # -- collectives with a deadline --------------------------------------------------
    def _wait(self, req, what: str) -> None:
        """Poll a non-blocking MPI request: spin briefly, then sleep (a waiting worker must not
        take a core from one still computing), and give up after `timeout` seconds."""
        deadline = time.monotonic() + self.timeout
        spins, pause = 0, 1e-4
        while not req.Test():
            if spins < 200:
                spins += 1
                continue
            if time.monotonic() > deadline:
                raise self.timed_out(what)
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def gather(self, values, what: str) -> np.ndarray:
        """[size, k] float64: every worker's `values`, in rank order, on every worker."""
        mine = np.ascontiguousarray(values, np.float64).reshape(-1)
        out = np.empty((self.size, mine.size), np.float64)
        self._wait(self.comm.Iallgather(mine, out), what)
        return out

    def broadcast(self, data: bytes | None, what: str) -> bytes:
        """Rank 0's bytes on every worker."""
        n = np.array([len(data) if self.main else 0], np.int64)
        self._wait(self.comm.Ibcast(n, root=0), what)
        buf = np.frombuffer(data, np.uint8).copy() if self.main else np.empty(int(n[0]), np.uint8)
        self._wait(self.comm.Ibcast(buf, root=0), what)
        return buf.tobytes()

    def allreduce_sum(self, arrays: list, what: str) -> None:
        """Sum float32 arrays in place over the workers, one all-reduce each, all in flight together."""
        reqs = [self.comm.Iallreduce(self.MPI.IN_PLACE, a, op=self.MPI.SUM) for a in arrays]
        for r in reqs:
            self._wait(r, what)

    def timed_out(self, what: str) -> WorkerTimeout:
        return WorkerTimeout(f"{what}: a worker did not answer within {self.timeout:g} s (--dist-timeout); it died "
                             f"or hangs, so the run stops here. {checkpoint_note(self.out)}")

    # -- what the training loop asks -----------------------------------------------------
    def shard(self, batch):
        return shard_rows(batch, self.rank, self.size)

    def agree(self, loss: float, signal):
        """The step's loss (sum of the workers' weighted losses, in rank order: the same float on
        every worker) and the stop signal any worker got (the highest), so all stop together."""
        got = self.gather([loss, signal or 0], "the step's loss exchange")
        stop = int(got[:, 1].max())
        return float(sum(got[:, 0].tolist())), (stop or None)

    def total(self, values):
        """Per-position sums over the workers (eval: loss*tokens and tokens)."""
        got = self.gather(values, "the eval totals")
        return [float(sum(got[:, i].tolist())) for i in range(got.shape[1])]

    def share_state(self, run, make):
        """Rank 0's starting state (fresh or from --resume, which only rank 0 reads) on every
        worker, with the learning-rate schedule's length a resumed run keeps."""
        from ..train.checkpoint import rng_from_state, rng_state
        tensors = ("lora", "m", "v")
        if self.main:
            st = make()
            meta = {k: v for k, v in st.items() if k not in tensors + ("rng",)}
            meta.update(rng=rng_state(st["rng"]), schedule_steps=run.optim_cfg.total_steps)
            blob = json.dumps(meta).encode()
        else:
            st, blob = {}, None
        meta = json.loads(self.broadcast(blob, "the starting state").decode())
        names = sorted(run.engine.shapes)
        for key in tensors:
            flat = np.concatenate([st[key][n].reshape(-1) for n in names]).astype(np.float32) if self.main else \
                np.empty(sum(int(np.prod(run.engine.shapes[n])) for n in names), np.float32)
            self._wait(self.comm.Ibcast(flat, root=0), "the starting state")
            if not self.main:
                st[key], off = {}, 0
                for n in names:
                    size = int(np.prod(run.engine.shapes[n]))
                    st[key][n] = flat[off:off + size].reshape(run.engine.shapes[n]).copy()
                    off += size
        if not self.main:
            run.optim_cfg.total_steps = meta.pop("schedule_steps")
            st.update({k: v for k, v in meta.items() if k != "rng"}, rng=rng_from_state(meta["rng"]))
        return st

    def check_identity(self, run) -> None:
        """Every worker must train the same model on the same data with the same artifact."""
        from dataclasses import asdict
        parts = {"model": run.model_hash, "training data": run.data.digest, "training graph": run.engine.graph_hash,
                 "settings": _digest(json.dumps(asdict(run.cfg), sort_keys=True, default=str))}
        mine = [int(_digest(v)[:12], 16) for v in parts.values()]
        got = self.gather(mine, "the start-up check")
        for i, what in enumerate(parts):
            odd = [r for r in range(self.size) if got[r, i] != got[0, i]]
            if odd:
                raise LoracError(f"worker {odd[0]} has another {what} than worker 0 (every host needs the same "
                                 "model, data and lorac version at the same paths)")

    def check_same(self, engine, step: int) -> None:
        """LoRA weights and AdamW moments identical on every worker (compared at checkpoints)."""
        lora, m, v = engine.state_numpy()
        h = hashlib.sha256()
        for d in (lora, m, v):
            for n in sorted(d):
                h.update(np.ascontiguousarray(d[n]).tobytes())
        got = self.gather([int(h.hexdigest()[:12], 16)], "the checkpoint's state comparison")
        odd = [r for r in range(self.size) if got[r, 0] != got[0, 0]]
        if odd:
            raise LoracError(f"after step {step} worker {odd[0]}'s LoRA state differs from worker 0's "
                             "(a bug in lorac's distributed training)")

    # -- device ----------------------------------------------------------------------------
    def pick_device(self, device) -> None:
        """This worker's device: the local rank-th of the host's (`device.select`: all stay
        visible, NCCL finds NVLink only between GPUs a process can see)."""
        device.select(self.local_rank)
        if device.GRAD_ALLREDUCE == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (docs/DISTRIBUTED.md)

    def attach(self, engine) -> None:
        """Make `engine` all-reduce its flat gradient buffers before each optimizer step."""
        from .. import devices
        device = devices.get(engine.device)
        if device.GRAD_ALLREDUCE == "nccl":
            from .nccl import NcclReducer
            self.grad_reducer = NcclReducer(self, int(os.environ.get(device.WORKER_DEVICE, "0")))
        else:
            self.grad_reducer = self._reduce_on_host
        engine.grad_reducer = self.grad_reducer

    def _reduce_on_host(self, flats: dict, scale: float) -> None:
        keys = sorted(flats)
        host = [flats[k].numpy() for k in keys]
        if scale != 1.0:
            for a in host:
                a *= np.float32(scale)
        self.allreduce_sum(host, "the gradient all-reduce")
        for k, a in zip(keys, host):
            flats[k].copyfrom(a)

    # -- failing -----------------------------------------------------------------------------
    def abort(self, code: int) -> None:
        """End the whole MPI job now (after this worker printed why): mpiexec stops every other worker."""
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        self.comm.Abort(code)


class WorkerTimeout(LoracError):
    """A collective ran past --dist-timeout."""


def exit_code(rc: int) -> int:
    """Called with the command's exit status: a worker that failed takes the whole MPI job down
    (none is left waiting for it); one whose run ended, finished or stopped by a signal that all
    workers agreed on, leaves through MPI_Finalize as usual."""
    if rc and isinstance(_world, Mpi) and not _world.done:
        _world.abort(rc)
    return rc


def checkpoint_note(out) -> str:
    """Where a stopped run continues from (checkpoints are written whole or not at all)."""
    root = Path(out) / "checkpoints"
    try:
        from ..train.checkpoint import load_checkpoint
        step = load_checkpoint(root).step
    except (LoracError, OSError):
        return "No checkpoint was written yet."
    return f"The last checkpoint (step {step}) is intact: continue with --resume {root}"


def _digest(text: str) -> str:
    return hashlib.sha256(str(text).encode()).hexdigest()
