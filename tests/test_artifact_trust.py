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


# a manifest.json as compiler/pipeline.py wrote it before the manifest became a record
# (core/manifest.py), signature cut to three inputs
OLD_MANIFEST = {
    "format": "lorac-artifact", "format_version": 2,
    "graph_sha256": "8a79634e986106d134aeb45e21c4a15cfa1d91ddfbee629c8b91f8c8069dbfbc",
    "target": {"family": "cpu", "request": {"kind": "cpu"}, "device": "cpu",
               "tvm": {"kind": "llvm", "tag": "", "keys": ["cpu"], "mcpu": "rocketlake"}},
    "dtype": "float32", "tune": 0, "lorac_version": "0.1.0", "tvm_version": "0.27.0.post1",
    "lorac_source": "9fbf468162c390e7b748ad61c5e6fd3618dcaaf7ddcb7698404d85d02df3a496", "library": "lib.so",
    "inputs": [{"name": "input_ids", "shape": [4, 64], "dtype": "int64", "relax_name": "input_ids"},
               {"name": "position_ids", "shape": [4, 64], "dtype": "int64", "relax_name": "position_ids"},
               {"name": "model.embed_tokens.weight", "shape": [100, 48], "dtype": "float32",
                "relax_name": "model_embed_tokens_weight"}],
    "outputs": [{"name": "loss", "shape": [], "dtype": "float32"}],
    "gemm": {"dispatched": 41, "left_to_tvm": [], "accumulating": []}, "units": [], "bound_inputs": False,
    "unit_calls": [], "memory": {"static_plan_bytes": 740352, "runtime_allocations": 1}, "extra": {},
    "compile_seconds": {"import": 0.048, "build": 1.092, "export": 0.371},
    "files": {"lib.so": "093469e6c417ae655c77e3ca059925e3aa7f1a26610790860bd2bfb071499879"},
    "manifest_sha256": "efe59d09d5dc3d133336aad6744f910bd35491690c8937c948ea4422cf7056f9"}


def test_the_manifest_record_reads_and_writes_the_json_of_before():
    """Manifest.from_json / to_json: an older manifest.json comes back field for field, in its
    order, and reads typed; a field it lacks takes its default."""
    from lorac.compiler import manifest as mf
    from lorac.core.manifest import Manifest
    m = Manifest.from_json(OLD_MANIFEST)
    assert json.dumps(m.to_json()) == json.dumps(OLD_MANIFEST)  # the same text: the same seal
    assert (m.target.family, m.target.device, m.library, m.static_plan_bytes, m.accumulating) == \
        ("cpu", "cpu", "lib.so", 740352, [])
    assert m.key_fields() == {"graph_sha256": OLD_MANIFEST["graph_sha256"], "target": {"kind": "cpu"},
                              "dtype": "float32", "tune": 0, "lorac_version": "0.1.0", "tvm_version": "0.27.0.post1",
                              "lorac_source": OLD_MANIFEST["lorac_source"]}
    key = mf.cache_key(mf.BuildRequest(OLD_MANIFEST["graph_sha256"], {"kind": "cpu"}, "float32"))
    assert {k: m.key_fields()[k] for k in ("graph_sha256", "target", "dtype", "tune")} == \
        {k: key[k] for k in ("graph_sha256", "target", "dtype", "tune")}
    lean = {k: v for k, v in OLD_MANIFEST.items() if k not in ("bound_inputs", "unit_calls", "memory", "gemm")}
    m = Manifest.from_json(lean)
    assert (m.bound_inputs, m.unit_calls, m.static_plan_bytes, m.accumulating) == (False, [], 0, [])


def test_the_written_manifest_is_the_record_as_json(built):
    """What compile_graph wrote is Manifest.to_json of what the runtime reads, byte for byte."""
    from lorac.core.manifest import Manifest
    _, art = built
    text = (Path(art) / "manifest.json").read_text()
    assert text == json.dumps(Manifest.from_json(json.loads(text)).to_json(), indent=1) + "\n"
    step = load_artifact(art)
    assert step.manifest.target.device == "cpu" and step.inputs == json.loads(text)["inputs"]


@pytest.mark.parametrize("error", [ImportError("No module named 'onnx'"),
                                   AttributeError("module 'tvm.ir._ffi_api' has no attribute 'RegisterOpAttr'")])
def test_a_miss_without_a_compiler_is_one_line(tmp_path, monkeypatch, error):
    """A cache miss where the compiler cannot be imported (the onnx pin missing, or a runtime-only
    TVM, whose compiler half fails on import with an AttributeError) says so in one line."""
    import builtins

    from lorac.runtime.engine.graphs import compiled
    real = builtins.__import__

    def no_compiler(name, *args, **kwargs):
        if name == "lorac.compiler":
            raise error
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_compiler)
    with pytest.raises(LoracError, match="is missing, and this machine cannot compile it") as e:
        compiled(lambda: pytest.fail("built without a compiler"), "0" * 16, "train", "cuda", "bfloat16", tmp_path)
    assert "\n" not in str(e.value) and str(error) in str(e.value)  # one line, naming the cause
