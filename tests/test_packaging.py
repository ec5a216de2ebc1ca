"""A plain install works: README's install line, run in a copy of the checkout, builds lorac's
wheel and installs it into a fresh venv with no extras (offline, the dependencies and the build
backend from a folder of wheels: tests/wheelhouse.py), and `lorac train --steps 2` runs there on
a tiny model, compiling its graphs with the TVM that the core dependencies bring."""
import json
import os
import subprocess
import sys
import venv

import pytest

pytest.importorskip("tvm")
pytest.importorskip("transformers")  # makes the tiny model


@pytest.mark.slow
def test_plain_install_trains(tmp_path):
    from tiny_model import make_corpus, make_model_dir
    from wheelhouse import build_wheelhouse
    wheels = build_wheelhouse(tmp_path / "wheels")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    py = bindir / "python"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    line = readme_install_line()
    assert line == ["pip", "install", "."], line  # from a clone: lorac is not on PyPI yet
    r = subprocess.run([str(py), "-m", *line, "-q", "--no-index", "--find-links", str(wheels)],
                       cwd=wheels.parent / "lorac-src", env={**clean, "PIP_CONFIG_FILE": os.devnull},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Warning" not in r.stderr, r.stderr[-3000:]  # no setuptools warning on the way
    r = subprocess.run([str(py), "-c", "import importlib.util as u; print([m for m in ('torch', 'transformers', "
                        "'onnxruntime', 'datasets') if u.find_spec(m)])"], capture_output=True, text=True, env=clean)
    assert r.stdout.strip() == "[]", r.stdout  # no test oracle or optional extra came along

    model = make_model_dir(tmp_path / "model", layers=1)
    corpus = make_corpus(tmp_path / "corpus.txt", n=40)
    out = tmp_path / "out"
    r = subprocess.run([str(bindir / "lorac"), "train", "--model", str(model), "--data", str(corpus), "--steps", "2",
                        "--batch", "1", "--seq", "16", "--rank", "2", "--eval-batches", "0", "--sample-tokens", "0",
                        "--out", str(out), "--cache-dir", str(tmp_path / "cache")],
                       cwd=tmp_path, env={**clean, "MPLCONFIGDIR": str(tmp_path / "mpl")},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"] == 2
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "loss.png").is_file()


def readme_install_line() -> list[str]:
    """The first `pip install` line of README's Quick start code block, its comment cut."""
    from wheelhouse import ROOT
    text = (ROOT / "README.md").read_text()
    start = text.index("## Quick start")
    line = next(l for l in text[start:].splitlines() if l.startswith("pip install"))
    return line.split("#", 1)[0].split()


BUILD = """
import json, sys, warnings
import setuptools.build_meta as backend
warnings.simplefilter("always")
for spec in sys.argv[2:]:  # the filters setup.sh gives pip (PYTHONWARNINGS syntax: action:message)
    action, message = spec.split(":", 1)
    warnings.filterwarnings(action, message)
out = {}
for hook in ("build_wheel", "build_editable"):
    with warnings.catch_warnings(record=True) as caught:
        name = getattr(backend, hook)(sys.argv[1])
    out[hook] = [name, [f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught]]
print(json.dumps(out))
"""


def test_builds_raise_no_setuptools_warning_and_ship_the_corpus(tmp_path):
    """`bash scripts/setup.sh` prints no setuptools warning: setuptools' build hooks, run as pip runs
    them for setup.sh (its PYTHONWARNINGS filters), warn about nothing, and the wheel holds the
    bundled corpus."""
    import re
    import shutil
    import zipfile
    from wheelhouse import ROOT
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "lorac-out"))
    filters = re.findall(r'PYTHONWARNINGS="([^"]+)"', (ROOT / "scripts" / "setup.sh").read_text())
    assert filters == ["ignore:Editable installation"]  # what setup.sh filters, and nothing more
    r = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path / "dist"), *filters[0].split(",")], cwd=src,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    built = json.loads(r.stdout.strip().splitlines()[-1])
    assert built["build_wheel"][1] == [] and built["build_editable"][1] == [], built
    names = zipfile.ZipFile(tmp_path / "dist" / built["build_wheel"][0]).namelist()
    corpus = {n.rsplit("/", 1)[1] for n in names if n.startswith("lorac/runtime/data/corpus/")}
    assert {"jargon_train.jsonl", "jargon_eval.jsonl", "LICENSE", "README.md"} <= corpus
