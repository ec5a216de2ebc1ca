"""CPU default schedules (compiler/targets/cpu/schedule.py): long reductions get lane accumulators
(an rfactor block), short ones stay a plain loop, and both give numpy's numbers."""
import numpy as np
import pytest

tvm = pytest.importorskip("tvm")


def _kernel(rows: int, cols: int, reduce):
    from tvm import te

    x = te.placeholder((rows, cols), "float32", name="x")
    y = te.placeholder((rows, cols), "float32", name="y")
    k = te.reduce_axis((0, cols), name="k")
    out = te.compute((rows,), lambda i: reduce(x[i, k] * y[i, k], axis=k), name="out")
    return te.create_prim_func([x, y, out])


@pytest.mark.parametrize("reduce_name, cols, lanes", [("sum", 4096, True), ("max", 4000, True),
                                                       ("sum", 48, False), ("sum", 1000, False)])
def test_reductions(reduce_name, cols, lanes):
    from tvm import te

    from lorac.compiler.targets.cpu.schedule import ParallelFallback

    target = tvm.target.Target({"kind": "llvm"})
    func = _kernel(37, cols, getattr(te, reduce_name))
    sch = ParallelFallback().apply(func, target, False)
    assert ('T.sblock("out_rf_update")' in sch.mod["main"].script()) == lanes

    lib = tvm.tirx.build(sch.mod, target=target)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((2, 37, cols)).astype("float32")
    out = tvm.runtime.tensor(np.zeros(37, "float32"))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y), out)
    want = getattr(np, reduce_name)((x * y).astype("float64"), axis=1)
    np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=2e-4)
