"""Seeded fuzzing of what lorac reads from users: data files, safetensors and GGUF headers,
config.json and the TOML run config. A few hundred generated cases; each must end in success
or in one LoracError line (ValueError for a model spec, as lorac.graphs raises), never in
another exception, within a time limit and without allocating what an absurd header claims."""
from __future__ import annotations

import json
import signal
import string
import struct
import tracemalloc
from contextlib import contextmanager

import numpy as np
import pytest

from lorac.runtime.errors import LoracError

SEED = 15
pytestmark = pytest.mark.usefixtures("confined")  # nothing written outside each test's folder (conftest.py)
MAX_PEAK = 64 << 20  # bytes of Python/numpy memory one case may allocate at its peak


class Hung(Exception):
    pass


@contextmanager
def bounded(case, seconds=20):
    """Run one case: fail it on an unexpected exception, a hang, or a large allocation."""
    def expired(*_):
        raise Hung(f"case {case!r} ran past {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    tracemalloc.start()
    try:
        yield
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert peak < MAX_PEAK, f"case {case!r} allocated {peak} bytes"


def expect_clean(fn, case, allowed=(LoracError,)):
    """fn() succeeds or raises one of `allowed` with a one-line message; anything else fails."""
    with bounded(case):
        try:
            fn()
        except allowed as e:
            assert str(e) and "\n" not in str(e), (case, str(e))
            return "error"
    return "ok"


def pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


# -- values a user (or an attacker) might put anywhere ---------------------------------------
ODD = [None, True, 0, -1, 2**63, 1e308, float("nan"), "", "x" * 300, "\u0000", "é\U0001F600", [], {}, [1, "a"],
       {"a": {"b": [None]}}, -2**70, 0.5, "12", "true", [[[]]]]


def odd_value(rng):
    return pick(rng, ODD)


def odd_text(rng, n=40):
    alphabet = string.printable + "éü\u2028\u0000\U0001F600<|im_end|>"
    return "".join(pick(rng, alphabet) for _ in range(int(rng.integers(0, n))))


# -- data files ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    from lorac.runtime.model.tokenizer import Tokenizer
    from tiny_model import CHATML, char_tokenizer
    return Tokenizer(char_tokenizer(string.printable + "éü"), eos_id=1, chat_template=CHATML, source="fuzz")


def random_record(rng):
    kind = int(rng.integers(9))
    if kind == 0:
        return {"text": odd_text(rng)}
    if kind == 1:
        return {"prompt": odd_text(rng), "completion": odd_text(rng)}
    if kind == 2:
        roles = ["user", "assistant", "system", "tool", 5, None]
        return {"messages": [{"role": pick(rng, roles), "content": pick(rng, [odd_text(rng), odd_value(rng)])}
                             for _ in range(int(rng.integers(0, 4)))]}
    if kind == 3:
        return {pick(rng, ["text", "prompt", "completion", "messages", "extra"]): odd_value(rng)}
    if kind == 4:
        return odd_value(rng)  # not an object at all
    if kind == 5:
        return {"messages": odd_value(rng)}
    if kind == 6:
        return "{" + odd_text(rng, 12)  # broken JSON
    if kind == 7:
        return b"\xff\xfe" + odd_text(rng, 8).encode()  # not UTF-8
    return {"text": odd_text(rng), "eos": odd_value(rng), "bos": odd_value(rng)}


def write_record(f, rec):
    if isinstance(rec, bytes):
        f.write(rec + b"\n")
    elif isinstance(rec, str) and rec.startswith("{"):
        f.write(rec.encode() + b"\n")
    else:
        f.write(json.dumps(rec).encode() + b"\n")


def test_fuzz_data_loader(tmp_path, tok):
    from lorac.runtime.data import load_dataset
    rng = np.random.default_rng(SEED)
    seen = {"ok": 0, "error": 0}
    for case in range(120):
        path = tmp_path / (f"c{case}.jsonl" if case % 4 else f"c{case}.txt")
        with open(path, "wb") as f:
            for _ in range(int(rng.integers(1, 6))):
                if path.suffix == ".txt":
                    f.write(odd_text(rng).encode(errors="surrogatepass") + pick(rng, [b"\n", b"\n\n", b""]))
                else:
                    write_record(f, random_record(rng))
        seq = int(pick(rng, [2, 3, 8, 64]))
        frac = float(pick(rng, [0.0, 0.05, 0.5]))
        seen[expect_clean(lambda: load_dataset(path, tok, seq, tok.vocab_size, eval_fraction=frac), path.name)] += 1
    assert seen["ok"] > 5 and seen["error"] > 30, seen  # both outcomes are exercised


# -- safetensors headers ------------------------------------------------------------------------
def _safetensors_bytes(header: dict, data: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


def test_fuzz_safetensors_headers(tmp_path):
    from lorac.runtime.model.weights import load_safetensors
    rng = np.random.default_rng(SEED)
    good = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}, "__metadata__": {"format": "pt"}}
    data = bytes(range(32))
    seen = {"ok": 0, "error": 0}
    for case in range(120):
        header = json.loads(json.dumps(good))
        how = case % 6
        if how == 0:  # a field of an entry replaced
            entry = header[pick(rng, ["a", "b"])]
            entry[pick(rng, ["dtype", "shape", "data_offsets"])] = pick(rng, ODD + [[0, 2**62], [-8, 0], [2**40], "I64"])
        elif how == 1:  # absurd shapes and offsets that claim gigabytes
            n = int(rng.integers(1, 2**40))
            header["a"] = {"dtype": "F32", "shape": [n, n], "data_offsets": [0, 4 * n * n]}
        elif how == 2:
            header[odd_text(rng, 8) or "k"] = odd_value(rng)
        elif how == 5:  # free-form metadata, which readers ignore
            header["__metadata__"] = {odd_text(rng, 8): odd_text(rng)}
        blob = _safetensors_bytes(header, data)
        if how == 3:  # the length field itself
            blob = struct.pack("<Q", int(rng.integers(0, 2**63))) + blob[8:]
        elif how == 4:  # cut short, or bytes flipped inside the header
            blob = bytearray(blob[: int(rng.integers(0, len(blob)))] if case % 2 else blob)
            for _ in range(3):
                if len(blob) > 9:
                    blob[int(rng.integers(8, len(blob)))] = int(rng.integers(256))
        path = tmp_path / f"c{case}.safetensors"
        path.write_bytes(bytes(blob))
        seen[expect_clean(lambda: load_safetensors(path), path.name)] += 1
    assert seen["ok"] > 5 and seen["error"] > 30, seen


# -- GGUF headers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    pytest.importorskip("gguf")
    from test_gguf import hf_weights, write_gguf
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, "llama", hf_weights("llama", np.random.default_rng(0), layers=1, hidden=16, heads=2, kv=1,
                                         head_dim=8, ffn=16, vocab=16), heads=2, kv=1, head_dim=8)
    return path


def test_fuzz_gguf_headers(tmp_path, gguf_file):
    from lorac.runtime.model.gguf import load_gguf
    rng = np.random.default_rng(SEED)
    good = gguf_file.read_bytes()
    meta_end = min(len(good), 2048)  # magic, counts, key/values and tensor infos live up front
    seen = {"ok": 0, "error": 0}
    for case in range(100):
        blob = bytearray(good)
        how = case % 4
        if how == 0:  # flipped bytes in the metadata
            for _ in range(int(rng.integers(1, 6))):
                blob[int(rng.integers(0, meta_end))] = int(rng.integers(256))
        elif how == 1:  # tensor or key/value count made absurd
            at = pick(rng, [8, 16])
            blob[at:at + 8] = struct.pack("<Q", int(rng.integers(0, 2**63)))
        elif how == 2:  # a length or count word somewhere in the metadata made absurd
            at = int(rng.integers(24, meta_end - 8))
            blob[at:at + 8] = struct.pack("<Q", int(pick(rng, [2**32, 2**48, 2**63 - 1, int(rng.integers(2**20))])))
        else:  # cut short
            blob = blob[: int(rng.integers(0, len(blob)))]
        path = tmp_path / f"c{case}.gguf"
        path.write_bytes(bytes(blob))
        seen[expect_clean(lambda: load_gguf(path), path.name, allowed=(LoracError, ValueError))] += 1
    assert seen["ok"] > 5 and seen["error"] > 30, seen


# -- config.json ------------------------------------------------------------------------------------
CONFIGS = {
    "qwen3": {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
              "max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    "mamba": {"model_type": "mamba", "vocab_size": 64, "hidden_size": 32, "state_size": 8, "expand": 2,
              "conv_kernel": 4, "num_hidden_layers": 2, "time_step_rank": "auto"},
}


def test_fuzz_model_config():
    """In the order a model loads: weights checked against the config, then the specs."""
    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.runtime.model.weights import check_weights, required_tensors
    rng = np.random.default_rng(SEED)
    weights = {k: {n: np.zeros(1, np.float32) for n in required_tensors(c)} for k, c in CONFIGS.items()}
    seen = {"ok": 0, "error": 0}
    for case in range(120):
        kind = pick(rng, sorted(CONFIGS))
        cfg = json.loads(json.dumps(CONFIGS[kind]))
        for _ in range(int(rng.integers(1, 4))):
            key = pick(rng, sorted(cfg) + ["sliding_window", "use_sliding_window", "layer_types", "rope_scaling",
                                          "hidden_act", "attention_bias", "ssm_cfg", "intermediate_size"])
            if rng.random() < 0.3:
                cfg.pop(key, None)
            else:
                cfg[key] = odd_value(rng)

        def build():
            check_weights(cfg, weights[kind], "fuzz")
            spec = ModelSpec.from_hf_config(cfg)
            TrainSpec(batch=1, seq=4, lora_targets=tuple(spec.targets)[:1], rank=2).validate(spec)
        seen[expect_clean(build, cfg, allowed=(LoracError, ValueError))] += 1
    assert seen["ok"] > 5 and seen["error"] > 30, seen


# -- the TOML run config -------------------------------------------------------------------------------
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return repr(v) if abs(v) < 2**63 else "1e30"
    if isinstance(v, float):
        return repr(v) if v == v and abs(v) < 1e300 else "nan"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v if x is not None and not isinstance(x, dict)) + "]"
    if isinstance(v, dict):
        return "{ a = 1 }"
    return json.dumps("" if v is None else str(v))


def test_fuzz_toml_run_config(tmp_path):
    from dataclasses import fields

    from lorac.runtime.cli import build_parser, train_config
    from lorac.runtime.config import TrainConfig
    rng = np.random.default_rng(SEED)
    keys = [f.name for f in fields(TrainConfig)] + ["stepz", "extra"]
    typed = {"int": [1, 3, 0, -2], "float": [1e-4, 0.5, -1.0], "bool": [True, False], "str": ["q_proj,v_proj", "0:1", "cpu"]}
    defaults = TrainConfig()
    seen = {"ok": 0, "error": 0}
    for case in range(120):
        lines = {}
        for _ in range(int(rng.integers(1, 5))):
            key = pick(rng, keys)
            d = getattr(defaults, key, None)
            kind = type(d).__name__ if isinstance(d, (bool, int, float)) else "str"
            lines[key] = pick(rng, typed[kind]) if rng.random() < 0.6 else pick(rng, ODD + [["q_proj"]])
        text = "".join(f"{k} = {_toml_value(v)}\n" for k, v in lines.items())
        if case % 10 == 0:
            text = text.replace("=", "", 1)  # not TOML
        path = tmp_path / f"c{case}.toml"
        path.write_text(text)

        def parse():
            cfg = train_config(build_parser().parse_args(["train", "--config", str(path)]))
            cfg.validate()
            cfg.layer_range(4)
        seen[expect_clean(parse, text)] += 1
    assert seen["ok"] > 5 and seen["error"] > 30, seen
