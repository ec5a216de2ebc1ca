"""An artifact is code: a cache entry whose files do not match its sealed manifest never runs,
a damaged entry is rebuilt, and concurrent builders of one entry do not collide."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from _compiler_graphs import assert_outputs_close, random_inputs, saved_training_graph
from lorac.core import artifact_cache
from lorac.core import integrity
from lorac.runtime.engine.artifact import load_artifact
from lorac.runtime.errors import LoracError

pytest.importorskip("tvm")
KEY = "0123456789abcdef" * 4
ENTRY = f"train-cpu-float32-{KEY[:16]}"  # the name engine.compiled gives graph KEY


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from lorac.compiler import compile_graph
    d = tmp_path_factory.mktemp("trust")
    path, model = saved_training_graph(d)
    return model, compile_graph(path, target="cpu", out_dir=d / "art")


def evil_library(folder: Path, marker: Path) -> Path:
    """A shared object whose load-time constructor writes `marker`: what an attacker would plant."""
    src = folder / "evil.c"
    src.write_text(textwrap.dedent(f"""
        #include <stdio.h>
        __attribute__((constructor)) static void pwn(void) {{
            FILE *f = fopen({json.dumps(str(marker))}, "w"); if (f) {{ fputs("ran", f); fclose(f); }}
        }}
    """))
    lib = folder / "evil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def _manifest(art) -> dict:
    return json.loads((Path(art) / "manifest.json").read_text())


def _write_manifest(art, m) -> None:
    (Path(art) / "manifest.json").write_text(json.dumps(m))


def test_the_planted_library_would_run_if_loaded(tmp_path):
    """Control for the tests below: loading the planted library does run its code."""
    marker = tmp_path / "ran"
    lib = evil_library(tmp_path, marker)
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(lib)!r})"], check=True)
    assert marker.read_text() == "ran"


def test_swapped_library_is_refused_before_it_runs(built, tmp_path):
    _, art = built
    a = Path(shutil.copytree(art, tmp_path / "a"))
    marker = tmp_path / "ran"
    shutil.copyfile(evil_library(tmp_path, marker), a / "lib.so")
    with pytest.raises(LoracError, match="lib.so does not match its recorded sha256"):
        load_artifact(a)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["../evil.so", "ABS"])
def test_library_outside_the_entry_is_refused_even_with_a_resealed_manifest(built, tmp_path, where):
    _, art = built
    a = Path(shutil.copytree(art, tmp_path / "a"))
    marker = tmp_path / "ran"
    evil = evil_library(tmp_path, marker)
    name = str(evil) if where == "ABS" else where
    m = _manifest(a)
    m["library"] = name
    m["files"][name] = integrity.sha256_file(evil)  # an attacker can recompute every checksum
    _write_manifest(a, integrity.seal(m, artifact_cache.SEAL))
    with pytest.raises(LoracError, match="a path outside the artifact"):
        load_artifact(a)
    assert not marker.exists()


def _swap_two_inputs(a: Path) -> None:
    m = _manifest(a)
    ins = m["inputs"]
    i, j = next((i, j) for i in range(len(ins)) for j in range(i + 1, len(ins))
                if ins[i]["shape"] == ins[j]["shape"] and ins[i]["dtype"] == ins[j]["dtype"])
    ins[i]["name"], ins[j]["name"] = ins[j]["name"], ins[i]["name"]
    _write_manifest(a, m)


def _drop_checksums(a: Path) -> None:  # an entry written before checksums existed
    m = _manifest(a)
    del m["files"], m["manifest_sha256"]
    _write_manifest(a, m)


DAMAGE = {
    "truncated library": (lambda a: (a / "lib.so").write_bytes((a / "lib.so").read_bytes()[:4096]), "lib.so does not match"),
    "empty library": (lambda a: (a / "lib.so").write_bytes(b""), "lib.so does not match"),
    "library gone": (lambda a: (a / "lib.so").unlink(), "lib.so is missing"),
    "broken manifest": (lambda a: (a / "manifest.json").write_text('{"format": "lorac-art'), "broken manifest"),
    "swapped input names": (_swap_two_inputs, "does not match its own checksum"),
    "no checksums": (_drop_checksums, "does not match its own checksum"),
    "unlisted file": (lambda a: (a / "extra.so").write_bytes(b"x"), "holds extra.so, a file its manifest.json does not list"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_entry_is_refused_in_one_line(built, tmp_path, case):
    _, art = built
    entry = Path(shutil.copytree(art, tmp_path / "a"))
    damage, message = DAMAGE[case]
    damage(entry)
    with pytest.raises(LoracError, match=message) as e:
        load_artifact(entry)
    assert "\n" not in str(e.value)
    assert artifact_cache.problem(entry) is not None


@pytest.mark.parametrize("case", ["truncated library", "swapped input names", "broken manifest"])
def test_damaged_cache_entry_is_rebuilt(built, tmp_path, case):
    from lorac.runtime.engine.tvm import compiled
    model, art = built
    cache = tmp_path / "cache"
    entry = Path(shutil.copytree(art, cache / ENTRY))
    DAMAGE[case][0](entry)
    logs = []
    assert compiled(lambda: model, KEY, "train", "cpu", "float32", cache, logs.append) == entry
    assert any("is unusable" in m and "rebuilding it" in m for m in logs), logs
    assert artifact_cache.problem(entry) is None
    inputs = random_inputs(model, 4)
    assert_outputs_close(load_artifact(entry)(inputs), load_artifact(art)(inputs), 1e-6)


def test_a_good_entry_is_used_as_is(built, tmp_path):
    from lorac.runtime.engine.tvm import compiled
    _, art = built
    entry = Path(shutil.copytree(art, tmp_path / "cache" / ENTRY))
    before = (entry / "lib.so").stat().st_mtime_ns
    fail = lambda: pytest.fail("a verified entry must not be rebuilt")
    assert compiled(fail, KEY, "train", "cpu", "float32", tmp_path / "cache") == entry
    assert (entry / "lib.so").stat().st_mtime_ns == before


BUILDER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from _compiler_graphs import small_training_graph
    from lorac.runtime.engine.tvm import compiled
    compiled(small_training_graph, {key!r}, "train", "cpu", "float32", sys.argv[1], lambda m: print(m, flush=True))
""")


@pytest.mark.slow
def test_two_cold_builders_of_one_entry_build_once(tmp_path):
    cache = tmp_path / "shared-cache"
    code = BUILDER.format(tests=str(Path(__file__).parent), key=KEY)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert "Traceback" not in err
    assert sum("compiling the train graph" in out for out, _ in outs) == 1, outs
    assert artifact_cache.problem(cache / ENTRY) is None
    leftovers = [p.name for p in cache.iterdir() if p.name not in (ENTRY, ENTRY + ".lock")]
    assert leftovers == []


def test_manifest_records_every_file_and_is_sealed(built):
    _, art = built
    m = _manifest(art)
    assert set(m["files"]) == {"lib.so"}
    assert m["files"]["lib.so"] == integrity.sha256_file(art / "lib.so")
    assert integrity.seal_ok(m, "manifest_sha256")
    assert np.all([integrity.member(art, n) is not None for n in m["files"]])
