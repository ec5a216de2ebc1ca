#!/usr/bin/env bash
# An arm64 Linux user space for running aarch64 artifacts under QEMU user-mode emulation
# (tests/test_aarch64_emulated.py, docs/TARGETS.md).
#
#   bash scripts/setup_aarch64.sh [ROOT]        # default ROOT: .venv/aarch64-root
#
# Makes ROOT with Debian bookworm's arm64 python3 (debootstrap's first stage, then the
# remaining packages unpacked: nothing of the arm64 system runs while it is made, so no
# binfmt_misc is needed) and, in ROOT/opt/lorac-site, the aarch64 wheels of apache-tvm,
# numpy and ml-dtypes for that python. Runs the check: `qemu-aarch64-static -L ROOT
# ROOT/usr/bin/python3` must import tvm and numpy. Needs root (apt-get), network access
# to Debian and PyPI, ~1 GB of disk and a few minutes. CI does not run it.
set -euo pipefail
cd "$(dirname "$0")/.."
root="${1:-.venv/aarch64-root}"
suite=bookworm  # python 3.11, the version lorac's wheels are fetched for below
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if ! command -v qemu-aarch64-static >/dev/null || ! command -v debootstrap >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static debootstrap >/dev/null
fi

if [ ! -x "$root/usr/bin/python3" ]; then
  rm -rf "$root.tmp"
  debootstrap --foreign --arch=arm64 --variant=minbase --include=python3,libgomp1 "$suite" "$root.tmp" "$mirror"
  # the first stage unpacked the essential packages only; unpack the rest of what it
  # downloaded (python3 and its libraries) the same way, keeping the merged-/usr links
  for deb in "$root.tmp"/var/cache/apt/archives/*.deb; do
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$root.tmp" --keep-directory-symlink
  done
  mv "$root.tmp" "$root"
fi

site="$root/opt/lorac-site"
if [ ! -d "$site/tvm" ]; then
  pyver="$(qemu-aarch64-static -L "$root" "$root/usr/bin/python3" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  rm -rf "$site.tmp"
  # the wheels of the lorac runtime's pieces as pip would pick them on an arm64 Linux box
  .venv/bin/python -m pip install -q --target "$site.tmp" --only-binary=:all: --implementation cp \
      --python-version "$pyver" --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
      --platform manylinux_2_28_aarch64 \
      "apache-tvm==0.27.0.post1" "numpy>=1.26" "ml-dtypes>=0.4,<0.7" typing-extensions
  mv "$site.tmp" "$site"
fi

qemu-aarch64-static -L "$root" -E PYTHONPATH="$site" -E TVM_USE_RUNTIME_LIB=1 "$root/usr/bin/python3" -c \
  'import platform, numpy, tvm; print("arm64 root ready:", platform.machine(), "numpy", numpy.__version__, "tvm", tvm.__version__)'
