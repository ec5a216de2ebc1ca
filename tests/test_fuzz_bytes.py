"""Seeded fuzzing with random and adversarial bytes (issue 31): the data readers, the safetensors and
GGUF readers and the chat-template renderer each take a few hundred inputs that are noise, a valid
file mutated (bytes flipped, cut, spliced with hostile snippets) or a known attack. Every case ends
in success or in one clean error line (LoracError; ValueError where lorac.graphs or gguf defines
it), never another exception, within its time bound, and nothing is written outside the test's
folder (the `confined` fixture of conftest.py watches every write through an audit hook).
About 15 s in all on the 2-core host.
"""
from __future__ import annotations

import json
import string
import struct
import time
import tracemalloc

import numpy as np
import pytest

from lorac.runtime.errors import LoracError
from test_fuzz import expect_clean, pick

pytestmark = pytest.mark.usefixtures("confined")
SEED = 31

# byte strings known to break parsers and tokenizers somewhere
HOSTILE = [b"[" * 200_000, b"{" * 50_000, b'"\\ud800"', b'"\\udfff\\ud800"', b"\x00" * 64, b"\xef\xbb\xbf",
           b"\r\n\r\n", "\u2028\u2029".encode(), b"\xff\xfe\xfd", b'1e99999', b"NaN", b"-Infinity",
           b'"' + b"a" * 70_000 + b'"', b"\n" * 5000, b"<|im_end|><|endoftext|>", b"\\", b"\x1b[2J",
           b'{"text": ' * 3000, "é\U0001F600".encode(), b'{"messages": [{"role": "assistant", "content": "\\ud83d"}]}']


# inside a JSON string value, and whole records, that each broke a reader once
IN_STRING = [b"\\ud800", b"\\udfff\\ud800", b"\\ud83d", b"\\u0000", "\u2028".encode(), b"<|im_end|>", b"\\n" * 3000,
             b"{{ 7 * 7 }}", b"\xc3\xa9\xf0\x9f\x98\x80"]
LINES = [b'{"text": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", b'{"text": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001,
         b'{"messages": [{"role": "user", "content": "\\udfff"}, {"role": "assistant", "content": "x"}]}',
         b'{"prompt": "\\ud800", "completion": "x"}', b'{"text": "' + b"a" * 200_000 + b'"}', b"[" * 100, b"{}",
         b'{"messages": []}', b'{"text": 1e999}', b'{"conversations": [{"from": "gpt", "value": "\\ud800"}]}']


def mutate(rng, blob: bytes) -> bytes:
    """`blob` with bytes flipped, cut short, or a hostile snippet spliced in (or pure noise)."""
    b = bytearray(blob)
    how = int(rng.integers(5))
    if how == 0 or not b:
        return rng.integers(0, 256, int(rng.integers(0, 4096)), dtype=np.uint8).tobytes()
    if how == 1:
        for _ in range(int(rng.integers(1, 8))):
            b[int(rng.integers(len(b)))] = int(rng.integers(256))
    elif how == 2:
        b = b[: int(rng.integers(len(b)))]
    else:
        at = int(rng.integers(len(b) + 1))
        b[at:at] = pick(rng, HOSTILE)
    return bytes(b)


# -- data readers ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    from tiny_model import CHATML, char_tokenizer

    from lorac.runtime.model.tokenizer import Tokenizer
    return Tokenizer(char_tokenizer(string.printable + "éü"), eos_id=1, chat_template=CHATML, source="fuzz")


SEEDS = [b'{"text": "the cat sat"}\n{"prompt": "q: ", "completion": "a."}\n',
         b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}\n',
         b'[{"instruction": "say", "output": "so"}, {"conversations": [{"from": "human", "value": "x"}, '
         b'{"from": "gpt", "value": "y"}]}]',
         b"a paragraph\nof text\n\nanother one\n"]


def test_fuzz_data_readers_with_bytes(confined, tok):
    from lorac.runtime.data import load_dataset
    rng = np.random.default_rng(SEED)
    seen = {"ok": 0, "error": 0}
    # each snippet inside a string of each kind of file, and each hostile record in a JSONL file, once
    hostile = [(seed, h, True) for seed in SEEDS for h in IN_STRING] + [(SEEDS[0], line, False) for line in LINES]
    for case in range(len(hostile) + 60):
        if case < len(hostile):
            seed, h, inside = hostile[case]
            at = next(seed.index(w) for w in (b"the", b"hi", b"say", b"para") if w in seed)
            blob = seed[:at] + h + seed[at:] if inside else seed + h + b"\n"
            suffix = ".txt" if seed.startswith(b"a para") else ".json" if seed.startswith(b"[") else ".jsonl"
        else:
            blob, suffix = mutate(rng, pick(rng, SEEDS)), pick(rng, [".jsonl", ".json", ".txt", ".md"])
        path = confined / f"d{case}{suffix}"
        path.write_bytes(blob)
        frac = float(pick(rng, [0.0, 0.2]))
        seen[expect_clean(lambda: load_dataset(path, tok, int(pick(rng, [2, 8, 64])), tok.vocab_size,
                                               eval_fraction=frac), path.name)] += 1
    assert seen["ok"] > 10 and seen["error"] > 40, seen


# -- safetensors and GGUF files --------------------------------------------------------------------------
def _safetensors() -> bytes:
    header = json.dumps({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                         "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(range(32))


def test_fuzz_safetensors_with_bytes(confined):
    from lorac.runtime.model.weights import load_safetensors
    rng = np.random.default_rng(SEED)
    good = _safetensors()
    seen = {"ok": 0, "error": 0}
    for case in range(200):
        blob = mutate(rng, good)
        if case % 5 == 1:  # noise in the tensor data only: a file that reads, with odd values
            blob = good[:-32] + rng.integers(0, 256, 32, dtype=np.uint8).tobytes()
        if case % 10 == 0:  # a header that is deep JSON, or not an object
            head = pick(rng, [b"[" * 100_000 + b"]" * 100_000, b"[1, 2]", b'"x"', b'{"a": ' * 2000])
            blob = struct.pack("<Q", len(head)) + head
        path = confined / f"w{case}.safetensors"
        path.write_bytes(blob)
        seen[expect_clean(lambda: load_safetensors(path), path.name)] += 1
    assert seen["ok"] > 5 and seen["error"] > 100, seen


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory):
    pytest.importorskip("gguf")
    from test_gguf import hf_weights, write_gguf
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, "llama", hf_weights("llama", np.random.default_rng(0), layers=1, hidden=16, heads=2, kv=1,
                                         head_dim=8, ffn=16, vocab=16), heads=2, kv=1, head_dim=8)
    return path.read_bytes()


def test_fuzz_gguf_with_bytes(confined, gguf_bytes):
    from lorac.runtime.model.gguf import load_gguf
    rng = np.random.default_rng(SEED)
    seen = {"ok": 0, "error": 0}
    for case in range(80):
        blob = mutate(rng, gguf_bytes)
        if case % 4 == 0:  # a GGUF magic before the noise: the reader goes past the first check
            blob = gguf_bytes[:8] + blob[8:]
        path = confined / f"m{case}.gguf"
        path.write_bytes(blob)
        seen[expect_clean(lambda: load_gguf(path), path.name, allowed=(LoracError, ValueError))] += 1
    assert seen["error"] > 40, seen


# -- chat templates --------------------------------------------------------------------------------------
FRAGMENTS = [
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "{{ bos_token }}", "{{ eos_token }}",
    "{{ messages|tojson }}", "{{ messages[0]['content']|upper }}", "{{ messages|length }}", "{{ 'x' * 100 }}",
    "{{ range(10)|join(',') }}", "{{ raise_exception('no') }}", "{{ undefined_name.attr }}", "{{ messages[99] }}",
    # attacks: sandbox escapes, work and memory bombs, recursion
    "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ cycler.__init__.__globals__.os }}",
    "{{ self._TemplateReference__context }}", "{{ lipsum.__globals__ }}", "{{ config.items() }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'a'|center(999999) * 999 }}", "{{ range(4000)|map('string')|join('x'|center(1000000)) }}",
    "{{ ('y'|center(500000)).join(range(100)|map('string')) }}", "{{ 9 ** 9999999 }}", "{{ '%999999999s' % 'a' }}",
    "{{ '{:>99999999}'.format('a') }}", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ ('ab' * 400000)|replace('a', 'aaaa') }}", "{{ ('a\n' * 400000)|indent(100) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ ('x ' * 100000)|wordwrap(1)|length }}", "{% for", "{{ }", "{% endfor %}", "{{ messages.__class__ }}",
]


def _messages(rng):
    roles = ["user", "assistant", "system", "tool"]
    text = lambda: "".join(pick(rng, list(string.printable + "é\u2028<|>{}%")) for _ in range(int(rng.integers(0, 30))))
    return [{"role": pick(rng, roles), "content": pick(rng, [text(), text(), "", "{{ 7*7 }}", "x" * 5000])}
            for _ in range(int(rng.integers(0, 5)))]


def test_fuzz_chat_templates(confined, monkeypatch):
    """Random compositions of template fragments, attacks included, over random conversations:
    each compiles and renders, or stops in one LoracError line within its time limit, without a
    large allocation (the renderer's own timer bounds time; tracemalloc the memory)."""
    from lorac.runtime.model import chat_template as ct
    monkeypatch.setattr(ct, "TIME_LIMIT", 0.5)
    rng = np.random.default_rng(SEED)
    seen = {"ok": 0, "error": 0}
    for case in range(120):
        parts = [pick(rng, FRAGMENTS) for _ in range(int(rng.integers(1, 4)))]
        if case % 7 == 0:  # noise spliced into a template
            parts.append(mutate(rng, pick(rng, FRAGMENTS).encode()).decode("utf-8", "replace"))
        source = "".join(parts)
        t0 = time.perf_counter()
        tracemalloc.start()
        try:
            out = ct.render(ct.compile_template(source), 0, messages=_messages(rng),
                            add_generation_prompt=bool(case % 2), bos_token="<s>", eos_token="</s>")
            assert isinstance(out, str)
            seen["ok"] += 1
        except LoracError as e:
            assert str(e) and "\n" not in str(e), (source, str(e))
            seen["error"] += 1
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert time.perf_counter() - t0 < 2 * ct.TIME_LIMIT + 1, source
        assert peak < 256 << 20, (source, peak)
    assert seen["ok"] > 10 and seen["error"] > 40, seen  # both ways exercised (a loaded host times more out)


def test_the_confinement_catches_a_write_elsewhere(tmp_path_factory):
    """The guard itself: a write outside the test's folder is recorded (the fixture would fail)."""
    import conftest
    start = list(conftest._CONFINED["outside"])
    other = tmp_path_factory.mktemp("elsewhere") / "f.txt"
    other.write_text("x")
    assert f"open {other}" in conftest._CONFINED["outside"] and any(
        e.startswith("os.mkdir") for e in conftest._CONFINED["outside"])
    conftest._CONFINED["outside"][:] = start
