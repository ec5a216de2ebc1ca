"""`lorac train ... --gpus N`: start N data-parallel workers on this host through MPI's mpiexec.

Each worker runs this same command line under mpiexec (it finds itself in an MPI job through
the launcher's environment, runtime/dist/__init__.py). This process only starts mpiexec, passes
the workers' output through, hands Ctrl-C / SIGTERM / SIGHUP on to them (they finish the step,
rank 0 saves a checkpoint, all exit 128 + signal), and turns MPI's way of reporting a failure
into one line:

- a worker that exits on an error prints `lorac: error: ...` and ends the MPI job (MPI_Abort);
  the same line from several workers is shown once, and MPI's abort banner not at all;
- a worker that dies (killed, out of memory, a crash) makes mpiexec stop all the others at
  once (MPICH's hydra: "BAD TERMINATION ..."); that banner becomes one line naming the worker,
  how it died, and the checkpoint a --resume continues from (checkpoints are written whole or
  not at all, so the last one is intact).

Several hosts: run mpiexec yourself (docs/DISTRIBUTED.md); the workers behave the same, and
mpiexec's own messages are shown as it prints them.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from . import checkpoint_note
from ..errors import LoracError

INSTALL = "pip install 'lorac[distributed]' (mpi4py and MPICH)"
# MPICH hydra's lines about a job that failed: said again, better, in our one line
BANNER = re.compile(r"^(=+$|=   |YOUR APPLICATION TERMINATED WITH THE EXIT STRING|This typically refers to a problem "
                    r"with your application|Please see the FAQ page|application called MPI_Abort|Abort\(\d+\) on node \d+|\[mpiexec@[^]]*\] "
                    r"(Exit codes:|Sending Ctrl-C|Press Ctrl-C again))")
EXIT_CODES = re.compile(r"^\[mpiexec@[^]]*\] Exit codes: (.*)$")
EXIT_STRING = re.compile(r"EXIT STRING: (.*)$")


def mpi_library() -> str:
    """The MPI library mpi4py uses ("MPICH Version: ..."), without starting MPI in this process."""
    try:
        import mpi4py
        mpi4py.rc.initialize = False
        from mpi4py import MPI
    except ImportError:
        raise LoracError(f"--gpus needs MPI to start the workers: {INSTALL}") from None
    except Exception as e:  # mpi4py present, but no libmpi it can load
        raise LoracError(f"--gpus: mpi4py cannot load an MPI library ({str(e).splitlines()[0]}): {INSTALL}") from None
    return MPI.Get_library_version().strip()


def find_mpiexec() -> str:
    """mpiexec beside this Python (where the mpich wheel puts it), else on PATH."""
    here = os.path.dirname(sys.executable)
    found = shutil.which("mpiexec", path=here) or shutil.which("mpiexec")
    if not found:
        raise LoracError(f"--gpus needs mpiexec to start the workers and none was found: {INSTALL}")
    return found


def command(n: int, argv: list[str], library: str) -> list[str]:
    extra = ["-print-all-exitcodes"] if library.startswith(("MPICH", "Intel")) else []  # hydra: who failed
    return [find_mpiexec(), "-n", str(n), *extra, sys.executable, "-m", "lorac.runtime.cli", *argv]


class Output:
    """Reads the workers' output (through mpiexec) and passes it on, keeping back MPI's failure
    banner and repeated error lines; remembers what the summary line needs."""

    def __init__(self):
        self.errors: list[str] = []
        self.exit_codes: list[int] = []
        self.exit_string = None
        self.signalled = False  # this process passed a signal on to the workers
        self.lock = threading.Lock()

    def feed(self, line: str, dest) -> None:
        text = line.rstrip("\n")
        with self.lock:
            m = EXIT_CODES.match(text)
            if m:  # "[mpiexec@host] Exit codes: [host] 0,9": one host, ranks in order
                self.exit_codes = [int(c) for part in re.findall(r"\] ([\d,]+)", " " + m.group(1))
                                   for c in part.split(",") if c]
                return
            m = EXIT_STRING.search(text)
            if m:
                self.exit_string = m.group(1).strip()
            if BANNER.match(text):
                return
            if text.startswith(("lorac: error:", "lorac: internal error:")):
                if text not in self.errors:
                    self.errors.append(text)
                return
            dest.write(line)
            dest.flush()

    def pump(self, stream, dest) -> threading.Thread:
        def run():
            for line in iter(stream.readline, ""):
                self.feed(line, dest)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t


def summary_line(out: Output, rc: int, n: int, cfg) -> str | None:
    """The one line that says why the run stopped (None: it did not fail)."""
    if out.errors:
        return out.errors[0]
    culprits = [r for r, c in enumerate(out.exit_codes) if c and c < 128]
    if rc == 0 or (out.exit_codes and not culprits) or (out.signalled and not out.exit_codes and rc >= 128):
        return None  # finished, or every worker stopped on a signal after a checkpoint (the summary says so)
    if not culprits and out.exit_string is None:  # mpiexec itself failed, or another MPI's launcher
        return f"lorac: error: mpiexec ended with exit status {rc} before the workers said why (see above). " \
               f"{checkpoint_note(cfg.out)}"
    who = f"worker {culprits[0]} of {n}" if culprits else "a worker"
    how = out.exit_string or f"exit status {rc}"
    how = re.sub(r"^Killed \(signal (\d+)\)$", lambda m: f"killed by {signal.Signals(int(m.group(1))).name}", how)
    return f"lorac: error: {who} died ({how}); mpiexec stopped the others with it. {checkpoint_note(cfg.out)}"


def launch(cfg, argv: list[str]) -> int:
    """Run `argv` (this train command) as cfg.gpus workers; returns the exit status."""
    cfg.validate()
    library = mpi_library()
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off in every worker (docs/DISTRIBUTED.md)
    cmd = command(cfg.gpus, argv, library)
    # mpiexec gets a session of its own: a Ctrl-C on the terminal reaches only this process, which
    # passes it on once (hydra takes a second Ctrl-C as "abort now")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, bufsize=1)
    out = Output()
    forward = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}

    def pass_on(signum, _frame):
        out.signalled = True
        proc.send_signal(forward[signum])
    previous = {s: signal.signal(s, pass_on) for s in forward}
    try:
        pumps = [out.pump(proc.stdout, sys.stdout), out.pump(proc.stderr, sys.stderr)]
        rc = proc.wait()
        for t in pumps:
            t.join(timeout=10)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    line = summary_line(out, rc, cfg.gpus, cfg)
    if line is None:
        return rc
    print(line, file=sys.stderr)
    return 2 if line.startswith("lorac: error:") else 1
