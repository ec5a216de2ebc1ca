"""Reliability, issue 31, hangs and internal errors (cases 18-26): a FIFO where a file is read, a
chat template slow on every render, a JSON line nested past Python's stack, a lone surrogate,
a step too large for the machine and a full disk each end in one `lorac: error:` line, within
a bound. The cases that hung before run in a child process with a timeout, so on the old code
they fail instead of hanging the suite.
"""
import json
import re
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import LORAC
from test_reliability import lorac, one_line_error, work  # noqa: F401 (work: the fixture)
from test_train_e2e import _train_args

pytest.importorskip("tvm")


def _child(args, timeout=60):
    """`lorac args` in a child process, killed after `timeout` s (a hang fails the test)."""
    try:
        return subprocess.run(LORAC + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"lorac {' '.join(map(str, args[:2]))} ... hung past {timeout} s")


def _last(r) -> str:
    lines = r.stderr.strip().splitlines()
    return lines[-1] if lines else ""


# -- 18, 19. a FIFO where lorac reads a file ------------------------------------------------------
@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"])
def test_a_fifo_in_the_model_folder_is_refused_not_waited_on(work, tmp_path, name):
    model = tmp_path / "model"
    shutil.copytree(work / "model", model)
    (model / name).unlink()
    os.mkfifo(model / name)
    t0 = time.time()
    r = _child(_train_args(work, tmp_path / "run", 2, "--model", model))
    assert r.returncode == 2 and _last(r).startswith("lorac: error:"), r.stderr[-2000:]
    assert f"{model / name}: is a FIFO (named pipe)" in _last(r) and time.time() - t0 < 60


@pytest.mark.parametrize("which", ["--data", "--eval-data", "--config", "--model"])
def test_a_fifo_as_data_config_or_gguf_is_refused(work, tmp_path, which):
    fifo = tmp_path / {"--data": "d.jsonl", "--eval-data": "e.txt", "--config": "run.toml", "--model": "m.gguf"}[which]
    os.mkfifo(fifo)
    r = _child(_train_args(work, tmp_path / "run", 2, which, fifo))
    assert r.returncode == 2 and f"{fifo}: is a FIFO (named pipe)" in _last(r), r.stderr[-2000:]


# -- 20. a chat template slow on every render ------------------------------------------------------
def test_a_slow_chat_template_stops_the_data_preparation_in_bounded_time(tmp_path, monkeypatch):
    """Each render takes ~0.1 s (under the 5 s per render); the run's total is bounded too."""
    from tiny_model import CHATML, char_tokenizer

    from lorac.runtime.data import load_dataset
    from lorac.runtime.errors import LoracError
    from lorac.runtime.model import chat_template as ct
    from lorac.runtime.model.tokenizer import Tokenizer
    monkeypatch.setattr(ct, "TOTAL_BASE", 1.0)  # 30 s in a run; the same rule, sooner
    slow = "{% set _ = ('x ' * 40000)|wordwrap(1) %}" + CHATML
    tok = Tokenizer(char_tokenizer(), eos_id=1, chat_template=slow, source="/models/slow-template")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "ho"}]}) + "\n"
                            for _ in range(400)))
    t0 = time.perf_counter()
    with pytest.raises(LoracError, match=r"the chat template of /models/slow-template is too slow: \d+ renders took") as e:
        load_dataset(data, tok, 32, tok.vocab_size)
    renders, spent = re.search(r"(\d+) renders took ([\d.]+) s", str(e.value)).groups()
    # the renders' own time: the total bound, plus at most one render past it (wall time outside the
    # renders is the host's: on a loaded one it is seconds, so the wall clock only guards a hang)
    assert float(spent) < 1.0 + ct.TOTAL_PER_RENDER * int(renders) + 0.5, str(e.value)
    assert time.perf_counter() - t0 < 60


def test_a_chat_template_join_over_a_generator_is_bounded_in_memory():
    import resource

    from lorac.runtime.errors import LoracError
    from lorac.runtime.model import chat_template as ct
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for source in ("{{ range(4000)|map('string')|join('x'|center(1000000)) }}",
                   "{{ ('x'|center(1000000)).join(range(4000)|map('string')) }}"):
        with pytest.raises(LoracError, match="its join would build more than"):
            ct.render(ct.compile_template(source), 0, messages=[])
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB: never the 4 GB join
    assert ct.render(ct.compile_template("{{ range(3)|map('string')|join(', ') }}"), 0) == "0, 1, 2"


# -- 22, 23. JSON the tokenizer or the parser cannot take ---------------------------------------
@pytest.mark.parametrize("line,match", [
    ('{"text": ' + "[" * 200_000 + "]" * 200_000 + "}", "c.jsonl:2: JSON nested too deeply"),
    ('{"text": "a\\ud800b"}', "c.jsonl:2: a lone UTF-16 surrogate \\ud800 at character 1"),
    ('{"messages": [{"role": "user", "content": "\\udfff"}, {"role": "assistant", "content": "x"}]}',
     "c.jsonl:2: a lone UTF-16 surrogate \\udfff"),
    ('{"prompt": "q", "completion": "\\ud83d"}', "c.jsonl:2: a lone UTF-16 surrogate \\ud83d"),
])
def test_json_the_readers_cannot_take_is_one_line_with_its_place(work, tmp_path, capsys, monkeypatch, line, match):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    one_line_error(*lorac(_train_args(work, tmp_path / "run", 2, "--data", data), capsys, monkeypatch), match)


def test_nested_model_json_is_one_line(work, tmp_path, capsys, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(work / "model", model)
    (model / "tokenizer_config.json").write_text("[" * 200_000 + "]" * 200_000)
    one_line_error(*lorac(_train_args(work, tmp_path / "run", 2, "--model", model), capsys, monkeypatch),
                   "tokenizer_config.json: not valid JSON (nested too deeply)")


# -- 24. a step larger than the machine's memory ----------------------------------------------------
def test_a_compiled_plan_beyond_the_machine_is_refused_before_it_runs(work, tmp_path, capsys, monkeypatch):
    """`--batch 100000 --seq 32` passed the lower bound (4 GiB) and TVM's allocation of its 27.7 GB
    plan failed with std::bad_alloc; here the lower bound is passed by construction and the
    machine made small, so the compiled plan (from the cache) is what must refuse."""
    from lorac.runtime import devices
    from lorac.runtime import limits
    monkeypatch.setattr(limits, "check_memory", lambda *a: None)
    monkeypatch.setattr(devices.get("cpu"), "memory_free", lambda: 1000)
    rc, err = lorac(_train_args(work, tmp_path / "run", 2), capsys, monkeypatch)
    one_line_error(rc, err, "GiB for its activations and workspace, this machine has 0.0 GiB available")
    assert "step    " not in err


def test_tvm_out_of_memory_is_one_line():
    from lorac.runtime.engine.artifact import Step
    from lorac.runtime.errors import LoracError

    class Vm:
        def __getitem__(self, _):
            import tvm
            def main(*args):
                raise tvm.error.InternalError("std::bad_alloc")
            return main
    step = Step.__new__(Step)
    step._vm, step.inputs, step.device, step.bound_inputs, step._captured = Vm(), [], "cpu", False, False
    step._check = lambda inputs: None
    with pytest.raises(LoracError, match=r"out of cpu memory while running the artifact \(std::bad_alloc\)"):
        step({})


# -- 25, 26. a full disk under --cache-dir ------------------------------------------------------------
@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (root only, where mounts are allowed; skipped elsewhere)."""
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True)
    if r.returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield d
    subprocess.run(["umount", str(d)])


def test_a_full_disk_under_the_cache_is_one_line_naming_it(work, tmp_path, tiny_disk):
    r = _child(_train_args(work, tmp_path / "run", 2, "--cache-dir", tiny_disk / "cache"), timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert _last(r).startswith(f"lorac: error: cannot write the compiled artifact {tiny_disk / 'cache'}/") and \
        f"MiB free in {tiny_disk / 'cache'}" in _last(r), _last(r)
    graph = tmp_path / "fwd.onnx"
    assert _child(["export", "--format", "onnx", "--model", work / "model", "--graph", "forward", "--seq", "8",
                   "--out", graph]).returncode == 0
    r = _child(["compile", graph, "--target", "cpu", "--out", tiny_disk / "art"], timeout=300)
    assert r.returncode == 2 and "no space left on device" in r.stderr and str(tiny_disk) in r.stderr, r.stderr


def test_a_link_failing_for_space_is_one_line(tmp_path, monkeypatch):
    """What TVM raises when the linker runs out of space (its message's first line is empty of
    meaning: `Compilation error:`) becomes one line saying the disk is full, and where."""
    from lorac.compiler import pipeline
    from lorac.core.errors import LoracError

    class Target:
        @staticmethod
        def export(*args):
            raise RuntimeError("Compilation error:\n/usr/bin/ld: final link failed: No space left on device\n"
                               "collect2: error: ld returned 1 exit status\n")
    built = pipeline._Built(None, None, [], [], {}, [], {}, False, {})
    with pytest.raises(LoracError, match=rf"cannot write the compiled artifact {tmp_path / 'art'}: no space left on "
                                         rf"device \([\d.]+ MiB free in {tmp_path}"):
        pipeline._publish(built, {}, "cpu", {}, Target, tmp_path / "art")
    assert os.listdir(tmp_path) == []  # no staging folder left
