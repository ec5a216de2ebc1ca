"""The family registry (graphs/families/): every family module is complete, names agree
between families, and the code outside the family modules does not branch on a family."""
import re
from pathlib import Path

import pytest

from lorac.graphs import ModelSpec
from lorac.graphs import families

ROOT = Path(__file__).resolve().parents[1]


def test_every_family_is_complete_and_found():
    mods = families.families()
    assert {m.__name__.rsplit(".", 1)[1] for m in mods} >= {"llama", "qwen3", "mamba"}
    for fam in mods:
        assert all(hasattr(fam, n) for n in families.REQUIRED), fam.__name__
        assert set(fam.HF_ARCHITECTURES) == set(fam.MODEL_TYPES), fam.__name__
        assert set(fam.GGUF_TARGETS) <= set(fam.TARGETS), fam.__name__
        for t in fam.TARGETS:
            a, b = fam.lora_name(3, t, "A"), fam.lora_name(3, t, "B")
            assert a.startswith("base_model.model.") and a.endswith(f".layers.3.{a.split('.')[-4]}.{t}.lora_A.weight")
            assert b == a.replace(".lora_A.", ".lora_B.")
            assert a.replace("base_model.model.", "").replace(".lora_A", "") == fam.weight_name(3, t)


def test_lookups():
    assert families.for_model_type("mistral") is families.for_model_type("llama")
    assert families.for_config({"architectures": ["Qwen3ForCausalLM"]}).MODEL_TYPES == ("qwen3",)
    assert families.for_target("in_proj").MODEL_TYPES == ("mamba",)
    assert set(families.peft_left_out()) == {"dt_proj", "out_proj"}
    with pytest.raises(ValueError, match="unsupported architecture model_type=.gpt2.; lorac supports .*llama, mistral, qwen2"):
        families.for_model_type("gpt2")
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelSpec.from_hf_config({"model_type": ["llama"]})


def test_gguf_meta_errors_name_the_key():
    meta = families.GgufMeta({"x.block_count": 0, "x.rope.freq_base": "a"}, "x")
    with pytest.raises(ValueError, match="x.block_count=0 must be a positive integer"):
        meta.count("block_count")
    with pytest.raises(ValueError, match="key x.embedding_length is missing"):
        meta.count("embedding_length")
    with pytest.raises(ValueError, match="must be a finite number"):
        meta.number("rope.freq_base", 1.0)


# code outside graphs/families/ that decides by a family's name (what the registry replaced)
BRANCHES = re.compile(r"""model_type["']?\)?\s*(==|!=|in|not in)\s*[("']|\.arch\s*(==|!=|in)\s*[("']|isinstance\([^)]*Spec\)"""
                      r"""|target in MAMBA_TARGETS|ALL_TARGETS""")


def test_nothing_outside_the_families_branches_on_one():
    files = list((ROOT / "runtime").rglob("*.py")) + list((ROOT / "compiler").rglob("*.py"))
    files += [ROOT / "graphs" / "compose.py"]
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in files
            for i, line in enumerate(f.read_text().splitlines(), 1) if BRANCHES.search(line)]
    assert not hits, "\n".join(hits)
