"""Every cache key is built from whole dataclasses (lorac.core.keys) plus versions: changing
ANY field of a keyed dataclass changes the key. A field added later is covered at once,
because the tests walk dataclasses.fields instead of a list."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest

from lorac.compiler import manifest as mf
from lorac.core.keys import canonical, digest
from lorac.core.loraplus import AdamWConstants
from lorac.graphs import ModelSpec, TrainSpec
from lorac.runtime.engine.graphs import Graphs, graph_key
from lorac.runtime.train.optim import SCHEDULE_FIELDS, LoraPlusConfig

LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
GEMMA2 = dict(model_type="gemma2", vocab_size=53, hidden_size=24, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=10, intermediate_size=37, sliding_window=4, query_pre_attn_scalar=7,
              attn_logit_softcapping=0.75, final_logit_softcapping=1.5)
PHI3 = dict(model_type="phi3", vocab_size=53, hidden_size=36, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, intermediate_size=37, tie_word_embeddings=False, sliding_window=5)
MAMBA = dict(model_type="mamba", vocab_size=40, hidden_size=24, state_size=4, num_hidden_layers=2, expand=2,
             conv_kernel=4)


def examples() -> dict:
    """One instance of every keyed dataclass, by class name."""
    return {
        "ModelSpec": ModelSpec.from_hf_config(LLAMA),
        "MambaSpec": ModelSpec.from_hf_config(MAMBA),
        "Gemma2Spec": ModelSpec.from_hf_config(GEMMA2),
        "Phi3Spec": ModelSpec.from_hf_config(PHI3),
        "TrainSpec": TrainSpec(batch=2, seq=16, extra={"scan_chunk": 4}),
        "AdamWConstants": AdamWConstants.of(LoraPlusConfig()),
        "BuildRequest": mf.BuildRequest("ab" * 32, {"kind": "cpu"}, "float32", 0),
    }


def changed(v):
    """A different value of the same kind as `v`."""
    if isinstance(v, bool):
        return not v
    if v is None:
        return 7
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v * 2 + 1
    if isinstance(v, str):
        return v + "x"
    if isinstance(v, tuple):
        return v[:-1] + (changed(v[-1]),) if v else ("x",)
    if isinstance(v, range):
        return range(v.start, v.stop + 1)
    if isinstance(v, dict):
        return {**v, "added": 1}
    raise TypeError(type(v))


def variants(obj):
    """(field name, a copy of `obj` with only that field changed) for every field."""
    for f in dataclasses.fields(obj):
        yield f.name, dataclasses.replace(obj, **{f.name: changed(getattr(obj, f.name))})


@pytest.mark.parametrize("name", list(examples()))
def test_every_field_changes_the_digest(name):
    obj = examples()[name]
    base = digest(obj)
    assert digest(examples()[name]) == base  # stable for equal values
    same = [f for f, other in variants(obj) if digest(other) == base]
    assert not same, f"{name}: changing {same} leaves the key as it was"


def test_every_spec_dataclass_has_an_example():
    """A new spec class in lorac.graphs (a new model family) needs an example above."""
    import lorac.graphs
    found = set()
    for m in pkgutil.walk_packages(lorac.graphs.__path__, "lorac.graphs."):
        mod = importlib.import_module(m.name)
        found |= {n for n, c in vars(mod).items() if isinstance(c, type) and dataclasses.is_dataclass(c)
                  and n.endswith("Spec") and c.__module__ == mod.__name__}
    assert found and found <= set(examples()), f"no example for {sorted(found - set(examples()))}"


def test_engine_graph_key_sees_every_spec_field():
    spec, train = examples()["ModelSpec"], examples()["TrainSpec"]
    base = graph_key("train", spec, train)
    for obj, pos in ((spec, 0), (train, 1)):
        for f, other in variants(obj):
            parts = [spec, train]
            parts[pos] = other
            assert graph_key("train", *parts) != base, f"{type(obj).__name__}.{f} is not in the engine's key"
    assert graph_key("eval", spec, train) != base


def _adamw_key(cfg) -> str:
    g = Graphs.__new__(Graphs)
    g.shapes, g.optim_cfg = {"x.lora_A.weight": (2, 3), "x.lora_B.weight": (3, 2)}, cfg
    build, parts, dtype = g._recipe("adamw")
    return graph_key("adamw", *parts)


def test_optimizer_key_sees_every_baked_setting_and_no_schedule_setting():
    """Each LoraPlusConfig field is either compiled into the optimizer graph (AdamWConstants,
    in the key) or a runtime input of it (SCHEDULE_FIELDS, not in the key: a schedule never
    recompiles). A new field must be one of them."""
    cfg = LoraPlusConfig()
    baked = {f.name for f in dataclasses.fields(AdamWConstants)}
    assert {f.name for f in dataclasses.fields(LoraPlusConfig)} == baked | set(SCHEDULE_FIELDS)
    assert not baked & set(SCHEDULE_FIELDS)
    base = _adamw_key(cfg)
    for f in dataclasses.fields(LoraPlusConfig):
        v = getattr(cfg, f.name)
        other = dataclasses.replace(cfg, **{f.name: (0.5, 0.75) if f.name == "betas" else changed(v) * 0.5
                                            if isinstance(v, float) else changed(v)})
        moved = _adamw_key(other) != base
        assert moved == (f.name in baked), f"LoraPlusConfig.{f.name}: key moved={moved}"


def test_optimizer_graph_is_built_from_its_key_alone():
    """The engine hands the graph builder the AdamWConstants object its key is made of: a
    graph that read any other setting would fail here (the object has no other fields)."""
    from lorac.graphs.optimizer import build_optimizer_graph
    shapes = {"x.lora_A.weight": (2, 3), "x.lora_B.weight": (3, 2)}
    cfg = LoraPlusConfig(weight_decay=0.1, max_grad_norm=0.5)
    a = build_optimizer_graph(shapes, AdamWConstants.of(cfg))
    b = build_optimizer_graph(shapes, cfg)
    assert a.SerializeToString() == b.SerializeToString()


def test_artifact_key_sees_every_request_field_and_the_versions():
    req = examples()["BuildRequest"]
    base = mf.cache_key(req)
    assert {"lorac_version", "tvm_version", "lorac_source"} <= set(base)
    for f, other in variants(req):
        assert mf.cache_key(other) != base, f"BuildRequest.{f} is not in the artifact's key"


def test_canonical_keeps_apart_what_repr_or_equality_would_merge():
    t = TrainSpec(batch=2, seq=16)
    assert t == dataclasses.replace(t, extra={"scan_chunk": 2})  # extra is out of ==
    assert digest(t) != digest(dataclasses.replace(t, extra={"scan_chunk": 2}))
    assert canonical(1) != canonical(1.0) and canonical((1, 2)) != canonical([1, 2])
    assert canonical(range(0, 3)) != canonical((0, 1, 2))
    with pytest.raises(TypeError):
        canonical(object())
