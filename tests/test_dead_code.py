"""compiler/passes/rewrite.py's eliminate_dead_code (a linear walk, then TVM's pass) gives what
TVM's DeadCodeElimination alone gives, and compiler/frontend_ops.py's Clip imports constant
bounds without the NaN guard that FoldConstant had to evaluate, keeping ONNX's NaN-bound meaning."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from _compiler_graphs import SMALL_QWEN3, nf4_layers
from onnx import TensorProto, helper

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402


def _count(mod) -> int:
    return sum(len(b.bindings) for f in mod.functions.values() if isinstance(f, relax.Function)
               for b in f.body.blocks)


def _built_module():
    """Dead chains in a dataflow block and after it, an unused impure call (kept), a used and an
    unused match_cast, and a private function nothing calls."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    y = relax.Var("y", relax.TensorType(None, "float32", ndim=2))
    with bb.function("main", [x, y], pure=False):
        with bb.dataflow():
            a = bb.emit(relax.op.add(x, x))
            dead1 = bb.emit(relax.op.multiply(a, x))
            bb.emit(relax.op.exp(dead1))  # dead, and reads a dead value
            ycast = bb.match_cast(y, relax.TensorType((4, 8), "float32"))
            bb.match_cast(y, relax.TensorType((4, 8), "float32"))  # unused match_cast
            b = bb.emit_output(relax.op.subtract(a, ycast))
            bb.emit_output(relax.op.negative(x))  # a dataflow output nothing reads
        bb.emit(relax.op.sqrt(b))  # dead outside a dataflow block
        bb.emit(relax.call_pure_packed("lorac.noop", b, ty_args=relax.ObjectType()))  # pure: dead
        bb.emit(relax.Call(relax.ExternFunc("lorac.print"), [b], ty_args=[relax.ObjectType()]))  # impure: stays
        out = bb.emit(relax.op.abs(b))
        bb.emit_func_output(out)
    z = relax.Var("z", relax.TensorType((4, 8), "float32"))
    with bb.function("unused", [z], private=True):
        bb.emit_func_output(relax.op.exp(z))
    return bb.get()


def _imported_nf4_module():
    """The lookups pass's output on a small NF4 training graph with offloaded checkpointing (its
    Offload/Fetch units are calls the walk must keep), before its dead code is removed."""
    from lorac.compiler.passes.lookups import _UnwrapUnsignedIndices
    from lorac.compiler.passes.rewrite import rewrite_functions
    from lorac.compiler.pipeline import import_onnx
    from lorac.compiler.targets import cuda as target_cuda
    from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph

    spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "hidden_size": 128, "intermediate_size": 192, "head_dim": 32})
    proto = build_training_graph(spec, TrainSpec(batch=2, seq=16, rank=4, lora_targets=tuple(ALL_TARGETS),
                                                 checkpointing=True, offload=True, quant=nf4_layers(spec)))
    mod, _, _ = import_onnx(proto, target_cuda, "bfloat16")
    return relax.transform.CanonicalizeBindings()(rewrite_functions(_UnwrapUnsignedIndices(mod), mod)), proto


@pytest.mark.parametrize("make", ["built", "nf4"])
def test_the_walk_removes_what_tvm_removes(make):
    from lorac.compiler.passes.rewrite import eliminate_dead_code

    mod = _built_module() if make == "built" else _imported_nf4_module()[0]
    before = _count(mod)
    ours, theirs = eliminate_dead_code(mod), relax.transform.DeadCodeElimination()(mod)
    tvm.ir.assert_structural_equal(ours, theirs)
    assert _count(ours) < before  # there was dead code, and it went
    assert _count(mod) == before  # the caller's module is left as it was
    if make == "built":
        assert _count(ours) == before - 6 and [gv.name_hint for gv in ours.get_global_vars()] == ["main"]
        assert "lorac.print" in ours.script()


def _clip_model(bound: float) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [5])
    lo = helper.make_tensor("lo", TensorProto.FLOAT, [], [bound])
    graph = helper.make_graph([helper.make_node("Clip", ["x", "lo"], ["y"])], "clip", [x], [y], [lo])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("bound", [-1.0, float("nan")])
def test_clip_with_a_constant_bound(bound):
    from lorac.compiler.pipeline import import_onnx
    from lorac.compiler.targets import cpu as target_cpu

    mod, _, _ = import_onnx(_clip_model(bound), target_cpu, "float32")
    ops = set()
    relax.analysis.post_order_visit(mod["main"], lambda e: isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and ops.add(e.op.name))
    assert ("relax.isnan" in ops) == np.isnan(bound)  # the guard only where the bound is NaN
    ex = tvm.compile(mod, "llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x = np.array([-3.0, -1.0, -0.5, 0.0, 2.0], np.float32)
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_array_equal(got, x if np.isnan(bound) else np.maximum(x, bound))  # NaN: no bound


def test_nf4_import_has_no_nan_guards():
    """The NF4 dequantization's clip (graphs/ops/quant.py) reaches TVM as a plain maximum."""
    mod, proto = _imported_nf4_module()
    assert any(n.op_type == "Clip" for n in proto.graph.node)
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and e.op.name == "relax.isnan" and found.append(e))
    assert not found
