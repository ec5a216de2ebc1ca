"""CachedLegalize (compiler/legalize_cache.py) shares one PrimFunc per op signature and gives
the same numbers as TVM's LegalizeOps alone, including calls that repeat an argument."""
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

    from lorac.compiler.legalize_cache import CachedLegalize

    passes = ([CachedLegalize] if cached else []) + [relax.transform.LegalizeOps()]
    mod = tvm.transform.Sequential(passes)(mod)
    n_prim = sum(isinstance(f, tvm.tirx.PrimFunc) for _, f in mod.functions_items())
    ex = tvm.compile(mod, tvm.target.Target({"kind": "llvm"}))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y)).numpy(), n_prim


def test_same_numbers_fewer_primfuncs():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 6)).astype("float32"), rng.standard_normal((4, 6)).astype("float32")
    want, n_plain = _run(_module(), False, x, y)
    got, n_cached = _run(_module(), True, x, y)
    ref = ((x * y) * (y * x * x) + 0.5).reshape(6, 4)
    ref = np.concatenate([ref, (x * y).reshape(6, 4), ref]).sum(1)
    np.testing.assert_allclose(want, ref, rtol=1e-5)
    np.testing.assert_array_equal(got, want)
    assert n_cached <= n_plain
