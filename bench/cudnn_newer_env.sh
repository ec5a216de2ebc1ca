#!/usr/bin/env bash
# Source on the GPU machine, from the repo root: the cuDNN that bench/cudnn_newer_carry.sh built
# (.devcarry/cudnnVER/, the one folder of that name carried) first on the library path, so
# torch (its libcudnn.so.9 is found through LD_LIBRARY_PATH before its own runpath) and cuDNN's
# frontend (it dlopens libcudnn.so.9 from LD_LIBRARY_PATH first) load the same library; the
# frontend from .devcarry/fe.tar.xz. Then run cuDNN's benches as usual, e.g.
#   python3 bench/cudnn_isolated_check.py --speed --only ragged_longest,ragged_unified,bias --json $OUT/iso.json
D=.devcarry
src=$(ls -d $D/cudnn[0-9]* | head -n 1)
lib=/tmp/$(basename "$src")
mkdir -p "$lib" /tmp/site_fe
for f in "$src"/*.xz; do
  n=$(basename "$f" .xz)
  [ -f "$lib/$n" ] || xz -dc "$f" > "$lib/$n"
done
[ -d /tmp/site_fe/cudnn ] || tar -xJf $D/fe.tar.xz -C /tmp/site_fe
export LD_LIBRARY_PATH=$lib PYTHONPATH=/tmp/site_fe:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c 'import cudnn, torch; print("cuDNN", cudnn.backend_version_string(), "frontend", cudnn.__version__, "torch sees", torch.backends.cudnn.version())'
