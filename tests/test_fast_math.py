"""compiler/passes/fast_math.py: the CPU targets' exp, sigmoid and softmax agree with numpy to fp32
rounding (~1e-6 relative at |x| = 30) over the range the graphs use, -inf included."""
import numpy as np
import pytest

tvm = pytest.importorskip("tvm")


def test_fast_exp_sigmoid_softmax_match_numpy():
    from tvm import relax

    from lorac.compiler.passes.fast_math import fast_math

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.Tuple([relax.op.exp(x), relax.op.sigmoid(x), relax.op.nn.softmax(x, axis=-1)]))
        bb.emit_func_output(out)
    mod = fast_math(bb.get())
    text = mod.script()
    assert "R.exp(" not in text and "R.sigmoid(" not in text and "softmax(" not in text.split("def main")[1]
    mod = relax.transform.LegalizeOps()(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.uniform(-30, 10, (3, 60)), [[-np.inf, -90.0, -1e-3, 0.0]] * 3], axis=1).astype(np.float32)
    e, s, sm = (t.numpy() for t in vm["main"](tvm.runtime.tensor(v)))
    ref_e = np.exp(v.astype(np.float64))
    normal = v > -87
    np.testing.assert_allclose(e[normal], ref_e[normal], rtol=1.5e-6, atol=0)
    assert (e[~normal] == 0).all()  # below fp32's smallest normal: exactly 0, like exp(-inf)
    np.testing.assert_allclose(s, 1 / (1 + np.exp(-v.astype(np.float64))), rtol=1.5e-6, atol=1e-30)
    z = np.exp(v.astype(np.float64) - v.max(-1, keepdims=True))
    np.testing.assert_allclose(sm, z / z.sum(-1, keepdims=True), rtol=2e-6, atol=1e-12)
