"""lorac.runtime: loads artifacts, trains, checkpoints, exports.

TVM's CPU thread pool spins its workers after each parallel kernel; the GEMMs lorac hands
to the BLAS (runtime/devices/cpu/blas.py) then compete with spinning TVM threads for the same cores. Measured on the
2-core host, SmolLM2-135M shape 4x128: 36 s per step with the default spin, 3.4 s with
none. So the runtime turns spinning off unless the user set it (before TVM starts its pool).
"""
import os

os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")

from .engine.artifact import load_artifact  # noqa: E402

__all__ = ["load_artifact"]
