"""Reliability, issue 31, data lost: lorac writes only where the user pointed it, never through a
link planted there, and replaces or deletes only folders it wrote itself (cases 1-8, and the
run folder's checks before training). Each test would fail on the code before the fix: the
file outside --out, the model folder or the link's target changed, or the command exited 0.
"""
import json
import os
import shutil
from pathlib import Path

import pytest

from test_reliability import lorac, one_line_error, tree_digest, work  # noqa: F401 (work: the fixture)
from test_train_e2e import _train_args

pytest.importorskip("tvm")


def _digest(path: Path) -> str:
    from lorac.core.integrity import sha256_file
    return sha256_file(path)


# -- 1. lorac compile --out over a folder it did not write --------------------------------------
def test_compile_never_replaces_a_folder_it_did_not_write(work, tmp_path, capsys, monkeypatch):
    graph = tmp_path / "fwd.onnx"
    rc, err = lorac(["export", "--format", "onnx", "--model", work / "model", "--graph", "forward", "--batch", "1",
                     "--seq", "8", "--out", graph], capsys, monkeypatch)
    assert rc == 0, err
    model = tmp_path / "model"
    shutil.copytree(work / "model", model)
    before = tree_digest(model)
    rc, err = lorac(["compile", graph, "--target", "cpu", "--out", model, "-q"], capsys, monkeypatch)
    assert rc == 2 and "is not a lorac artifact" in err and f"holds config.json" in err, err
    assert tree_digest(model) == before
    art = tmp_path / "art"
    art.mkdir()  # an empty folder may be filled, an artifact replaced
    for extra in ([], ["--force"]):
        rc, err = lorac(["compile", graph, "--target", "cpu", "--out", art, "-q", *extra], capsys, monkeypatch)
        assert rc == 0, err
    assert (art / "manifest.json").is_file()


# -- 2, 3, 14, 15, 21. shard paths of model.safetensors.index.json ---------------------------
def _sharded(work, tmp_path, shard: str) -> tuple[Path, Path]:
    """A copy of the tiny model whose only shard is `shard` (as the index names it): returns
    (model folder, the shard file it points at)."""
    from safetensors import safe_open
    d = tmp_path / "sharded"
    shutil.copytree(work / "model", d)
    with safe_open(str(d / "model.safetensors"), framework="numpy") as f:
        names = list(f.keys())
    target = Path(shard) if os.path.isabs(shard) else d / shard
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(d / "model.safetensors", target)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {n: shard for n in names}}))
    return d, target


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_shards_outside_the_model_folder_are_neither_read_nor_written(work, tmp_path, capsys, monkeypatch, where):
    shard = str(tmp_path / "elsewhere" / "victim.safetensors") if where == "absolute" else "../outside.safetensors"
    model, victim = _sharded(work, tmp_path, shard)
    before = _digest(victim)
    out = tmp_path / "out" / "merged"
    rc, err = lorac(["export", "--checkpoint", work / "ref" / "checkpoints", "--format", "merged", "--model", model,
                     "--out", out], capsys, monkeypatch)
    one_line_error(rc, err, "lies outside the model folder")
    assert _digest(victim) == before and not out.exists()
    assert not (out.parent / "outside.safetensors").exists()  # case 3: nothing written beside --out
    rc, err = lorac(_train_args(work, tmp_path / "run", 2, "--model", model), capsys, monkeypatch)
    one_line_error(rc, err, "lies outside the model folder")  # cases 14, 15: not read for training


@pytest.mark.parametrize("weight_map", [5, [1, 2], {"model.embed_tokens.weight": 3}])
def test_a_malformed_weight_map_is_one_line(work, tmp_path, capsys, monkeypatch, weight_map):
    model, _ = _sharded(work, tmp_path, "model-00001-of-00001.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    rc, err = lorac(_train_args(work, tmp_path / "run", 2, "--model", model), capsys, monkeypatch)
    one_line_error(rc, err, "model.safetensors.index.json: ")


def test_a_well_formed_sharded_model_still_trains_and_merges(work, tmp_path, capsys, monkeypatch):
    model, _ = _sharded(work, tmp_path, "model-00001-of-00001.safetensors")
    out = tmp_path / "merged"
    rc, err = lorac(["export", "--checkpoint", work / "ref" / "checkpoints", "--format", "merged", "--model", model,
                     "--out", out], capsys, monkeypatch)
    assert rc == 0, err
    assert (out / "model-00001-of-00001.safetensors").is_file() and (out / ".lorac-export.json").is_file()


# -- 4-7. links planted in --out ----------------------------------------------------------------
@pytest.mark.parametrize("name", [".lorac.lock", "metrics.jsonl", "loss.png", "summary.json", "checkpoints"])
def test_a_link_planted_in_out_is_refused_and_its_target_untouched(work, tmp_path, capsys, monkeypatch, name):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(victim)
    rc, err = lorac(_train_args(work, out, 2), capsys, monkeypatch)
    one_line_error(rc, err, f"{out / name} is a symbolic link")
    assert victim.read_text() == "precious\n"


def test_run_files_are_never_written_through_a_link(tmp_path):
    """Below the up-front check: each writer of a run file replaces or refuses a link at its name."""
    from lorac.core import atomic
    from lorac.core import locks
    from lorac.runtime.errors import LoracError
    from lorac.runtime.files import open_run_file
    from lorac.runtime.train.plot import plot_metrics
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for name in ("metrics.jsonl", "summary.json", "loss.png", ".lorac.lock", "appended.jsonl"):
        (tmp_path / name).symlink_to(victim)
    with open_run_file(tmp_path / "metrics.jsonl") as f:  # a fresh file replaces the name
        f.write(json.dumps({"step": 1, "loss": 1.0, "lr": 1e-3}) + "\n")
    atomic.write_text(tmp_path / "summary.json", "{}")
    plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    with pytest.raises(LoracError, match="is a symbolic link"):
        locks.acquire(tmp_path / ".lorac.lock", wait=False)
    with pytest.raises(LoracError, match="is a symbolic link"):
        open_run_file(tmp_path / "appended.jsonl", append=True)
    assert victim.read_text() == "precious\n"
    for name in ("metrics.jsonl", "summary.json", "loss.png"):
        assert not (tmp_path / name).is_symlink() and (tmp_path / name).stat().st_size > 0
    os.link(victim, tmp_path / "hardlink.lock")  # a hard link to another file is no lock file either
    with pytest.raises(LoracError, match="not a plain file of its own"):
        locks.acquire(tmp_path / "hardlink.lock", wait=False)
    assert victim.read_text() == "precious\n"


# -- 8. a merged export over a folder holding another model -------------------------------------
def test_merged_export_replaces_only_its_own_earlier_export(work, tmp_path, capsys, monkeypatch):
    ck = work / "ref" / "checkpoints"
    other = tmp_path / "other-model"
    shutil.copytree(work / "model", other)  # config.json, model.safetensors, tokenizer: all "export files"
    before = tree_digest(other)
    rc, err = lorac(["export", "--checkpoint", ck, "--format", "merged", "--out", other], capsys, monkeypatch)
    one_line_error(rc, err, "but no .lorac-export.json: lorac's export did not write it")
    assert tree_digest(other) == before
    link = tmp_path / "link"
    link.symlink_to(other)
    rc, err = lorac(["export", "--checkpoint", ck, "--format", "merged", "--out", link], capsys, monkeypatch)
    one_line_error(rc, err, "is a symbolic link")
    assert tree_digest(other) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (empty, empty):  # an empty folder, then lorac's own export of it
        rc, err = lorac(["export", "--checkpoint", ck, "--format", "merged", "--out", out], capsys, monkeypatch)
        assert rc == 0, err
    for fmt, name in (("gguf", "a.gguf"), ("onnx", "g.onnx")):  # a file export replaces only its own format
        mine = tmp_path / name
        mine.write_text("my notes\n")
        extra = ["--checkpoint", ck] if fmt == "gguf" else ["--model", work / "model"]
        rc, err = lorac(["export", *extra, "--format", fmt, "--out", mine], capsys, monkeypatch)
        one_line_error(rc, err, "is not a")
        assert mine.read_text() == "my notes\n"
        mine.unlink()
        for _ in range(2):
            rc, err = lorac(["export", *extra, "--format", fmt, "--out", mine], capsys, monkeypatch)
            assert rc == 0, err


# -- the run folder, checked before training ----------------------------------------------------
def test_train_refuses_an_out_inside_what_it_reads_before_training(work, tmp_path, capsys, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(work / "model", model)
    before = tree_digest(model)
    for out, match in [(model, "which this run reads"), (model / "sub", "which this run reads"),
                       (work / "model", "looks like a model directory")]:  # another model's folder
        rc, err = lorac(_train_args(work, out, 2, "--model", model), capsys, monkeypatch)
        one_line_error(rc, err, match)
    assert tree_digest(model) == before and not (work / "model" / ".lorac.lock").exists()
    adapter_src = tmp_path / "run" / "adapter"  # --adapter OUT/adapter: the run's export would replace it
    rc, err = lorac(["export", "--checkpoint", work / "ref" / "checkpoints", "--out", adapter_src], capsys, monkeypatch)
    assert rc == 0, err
    rc, err = lorac(_train_args(work, tmp_path / "run", 2, "--adapter", adapter_src), capsys, monkeypatch)
    one_line_error(rc, err, f"the run would replace {adapter_src}, which --adapter reads")


def test_an_adapter_link_to_the_model_is_refused_before_training(work, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "adapter").symlink_to(work / "model", target_is_directory=True)
    before = tree_digest(work / "model")
    rc, err = lorac(_train_args(work, out, 2), capsys, monkeypatch)
    one_line_error(rc, err, "adapter is a symbolic link")
    assert "step" not in err  # refused before the first step, not after the whole run
    assert tree_digest(work / "model") == before
    (out / "adapter").unlink()
    (out / "adapter").mkdir()
    (out / "adapter" / "notes.txt").write_text("mine")
    rc, err = lorac(_train_args(work, out, 2), capsys, monkeypatch)
    one_line_error(rc, err, "adapter holds notes.txt, which an export does not write")


def test_an_adapter_from_a_run_before_markers_is_still_replaced(work, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(work / "ref", out)
    (out / "adapter" / ".lorac-export.json").unlink(missing_ok=True)  # as a run before markers left it
    (out / ".lorac.lock").touch()
    rc, err = lorac(_train_args(work, out, 2), capsys, monkeypatch)
    assert rc == 0, err[-2000:]
    assert (out / "adapter" / ".lorac-export.json").is_file()
