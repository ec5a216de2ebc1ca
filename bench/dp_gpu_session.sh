#!/usr/bin/env bash
# NOT RUN YET (no 2-GPU machine was lent so far). Issue 14's GPU run: lorac on 1 and 2 H200s
# (NCCL all-reduce, MPI launch) against torch DDP + PEFT under torchrun, from the repo root.
# Built on the dev box first, both under .devcarry/ (git-ignored; carried, 64 MiB a call):
#   .devcarry/rt or rt.tar.xz   runtime-only TVM and the cp312 tvm-ffi/cuDNN-frontend wheels, as
#                               bench/h200_env.sh describes (bench/prepare_h200.py copies TVM's runtime)
#   .devcarry/dp                .venv/bin/python bench/dp_gpu.py prepare .devcarry/dp  (artifacts, data,
#                               cp312 mpi4py + mpich wheels; no weights: made on the device from seed 0)
# keeping the carried total within 64 MiB (rt.tar.xz is about a third of rt/).
# then on the nvidia-h200-x2 machine:  bash bench/dp_gpu_session.sh OUT_DIR
set -u
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off in every process started here
source bench/h200_env.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .devcarry/dp/whl/*.whl
# the mpich wheel, installed with --target: mpiexec in /tmp/site/bin, libmpi in /tmp/site/lib
export PATH=/tmp/site/bin:$PATH LD_LIBRARY_PATH=/tmp/site/lib:${LD_LIBRARY_PATH:-}
nvidia-smi -L
python3 -c "import mpi4py.MPI as M; print(M.Get_library_version().splitlines()[0])"
python3 bench/dp_gpu.py device .devcarry/dp "$1"
