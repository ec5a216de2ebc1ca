"""CachedLegalize (compiler/passes/legalize_cache.py) legalizes each op signature once and gives the
same numbers as TVM's LegalizeOps alone, including calls that repeat an argument.

What the cache saves is work, not PrimFuncs: the BlockBuilder merges structurally equal
PrimFuncs either way, so counting them cannot tell a working cache from one that does
nothing. The test counts the op legalizations (FLegalize calls) instead."""
import numpy as np
import pytest

tvm = pytest.importorskip("tvm")


def _module():
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 6), "float32"))
    y = relax.Var("y", relax.TensorType((4, 6), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            sq = bb.emit(relax.op.multiply(x, x))  # one-argument PrimFunc
            xy = bb.emit(relax.op.multiply(x, y))  # same signature with distinct arguments
            yx = bb.emit(relax.op.multiply(y, sq))  # argument order matters
            s = bb.emit(relax.op.add(relax.op.multiply(xy, yx), relax.const(np.full((4, 6), 0.5, "float32"))))
            r = bb.emit(relax.op.reshape(s, (6, 4)))
            t = bb.emit(relax.op.concat([r, relax.op.reshape(xy, (6, 4)), r], axis=0))
            out = bb.emit_output(relax.op.sum(t, axis=[1]))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, cached: bool, x, y):
    from tvm import relax

    from lorac.compiler.passes.legalize_cache import CachedLegalize

    passes = ([CachedLegalize] if cached else []) + [relax.transform.LegalizeOps()]
    mod = tvm.transform.Sequential(passes)(mod)
    n_prim = sum(isinstance(f, tvm.tirx.PrimFunc) for _, f in mod.functions_items())
    ex = tvm.compile(mod, tvm.target.Target({"kind": "llvm"}))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y)).numpy(), n_prim


def test_same_numbers_as_legalize_ops():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 6)).astype("float32"), rng.standard_normal((4, 6)).astype("float32")
    want, n_plain = _run(_module(), False, x, y)
    got, n_cached = _run(_module(), True, x, y)
    ref = ((x * y) * (y * x * x) + 0.5).reshape(6, 4)
    ref = np.concatenate([ref, (x * y).reshape(6, 4), ref]).sum(1)
    np.testing.assert_allclose(want, ref, rtol=1e-5)
    np.testing.assert_array_equal(got, want)
    assert n_cached == n_plain


def test_each_signature_is_legalized_once(monkeypatch):
    """9 op calls, 6 signatures: multiply(x, x) (one distinct argument), multiply of two
    distinct [4, 6] tensors (3 calls), add, reshape to [6, 4] (2 calls), concat, sum."""
    from tvm import relax

    from lorac.compiler.passes.legalize_cache import CachedLegalize

    legalized = []
    get_attr = tvm.ir.Op.get_attr

    def counting(op, name):  # the pass asks op.get_attr("FLegalize"); LegalizeOps (C++) does not
        f = get_attr(op, name)
        if name != "FLegalize" or f is None:
            return f
        return lambda bb, call: (legalized.append(op.name), f(bb, call))[1]

    monkeypatch.setattr(tvm.ir.Op, "get_attr", counting)
    out = CachedLegalize(_module())
    calls = []
    relax.analysis.post_order_visit(out["main"], lambda e: isinstance(e, relax.Call) and calls.append(e.op.name))
    assert calls.count("relax.call_tir") == 9 and len(calls) == 9  # every op call became a call_tir
    assert sorted(legalized) == sorted(["relax.multiply", "relax.multiply", "relax.add", "relax.reshape",
                                        "relax.concat", "relax.sum"])
