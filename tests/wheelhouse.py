"""A folder of wheels for an offline `pip install --no-index --find-links`: lorac's own wheel
built from this checkout, and the wheels of its core dependencies and of its build backend
(setuptools, for `pip install .` from the checkout's copy beside the folder) rebuilt from the copies
installed in this environment (a wheel is a zip of the installed files plus their
.dist-info), so the packaging test needs no index and no network.
"""
from __future__ import annotations

import importlib.metadata as md
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def core_closure(project: str = "lorac") -> list[md.Distribution]:
    """The installed distributions a plain `pip install project` pulls in (no extras)."""
    env = {**default_environment(), "extra": ""}
    seen, todo, out = set(), [project], []
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        dist = md.distribution(name)
        if name != canonicalize_name(project):
            out.append(dist)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return out


def repack(dist: md.Distribution, folder: Path) -> Path:
    """An installed distribution back into a wheel (stored, not compressed: it is read once)."""
    tags = [line.split(":", 1)[1].strip() for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag:")]
    tag = ".".join(sorted({t.split("-")[0] for t in tags})) + "-" + ".".join(sorted({t.split("-")[1] for t in tags})) \
        + "-" + ".".join(sorted({t.split("-")[2] for t in tags}))
    name = dist.metadata["Name"].replace("-", "_")
    path = folder / f"{name}-{dist.version}-{tag}.whl"
    root = Path(dist.locate_file(""))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for f in dist.files:
            rel = str(f)
            if rel.startswith("..") or "__pycache__" in rel or not (root / rel).is_file():
                continue  # console scripts are remade from entry_points.txt; bytecode by pip
            z.write(root / rel, rel)
    return path


def build_wheelhouse(folder: Path) -> Path:
    """lorac's wheel, built from a copy of the checkout (setuptools leaves build/ where it builds),
    and its core dependencies' wheels, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder.parent / "lorac-src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "lorac-out"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(folder), str(src)], check=True, capture_output=True, timeout=600)
    for dist in core_closure() + [md.distribution("setuptools")]:  # setuptools: `pip install .` builds with it
        repack(dist, folder)
    return folder
