"""GEMM dispatch (compiler/passes/gemm.py): transposes fold into the GEMM call and are never emitted
when only matmuls read them; a transpose that something else reads, or that a matmul left
to TVM reads, stays; the numbers equal numpy's."""
import numpy as np
import pytest

tvm = pytest.importorskip("tvm")


def _module():
    from tvm import relax

    bb = relax.BlockBuilder()
    f32, i32 = "float32", "int32"
    x = relax.Var("x", relax.TensorType((4, 8), f32))
    w = relax.Var("w", relax.TensorType((6, 8), f32))
    v = relax.Var("v", relax.TensorType((8, 6), f32))
    i = relax.Var("i", relax.TensorType((4, 8), i32))
    j = relax.Var("j", relax.TensorType((6, 8), i32))
    with bb.function("main", [x, w, v, i, j]):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(w, [1, 0]))  # only matmuls read it: folded twice
            y1 = bb.emit(relax.op.matmul(x, wt))
            y2 = bb.emit(relax.op.matmul(relax.op.multiply(x, relax.const(2.0, f32)), wt))
            vt = bb.emit(relax.op.permute_dims(v, [1, 0]))  # also read by an add: stays
            y3 = bb.emit(relax.op.add(relax.op.matmul(vt, relax.op.permute_dims(x, [1, 0])),
                                             relax.op.strided_slice(vt, [1], [0], [4])))
            jt = bb.emit(relax.op.permute_dims(j, [1, 0]))  # an int matmul stays TVM's: jt stays
            y4 = bb.emit(relax.op.matmul(i, jt))
            out = bb.emit_output(relax.Tuple([y1, y2, y3, y4]))
        bb.emit_func_output(out)
    return bb.get()


def _count(mod, op_name):
    from tvm import relax

    n = []
    relax.analysis.post_order_visit(
        mod["main"], lambda e: n.append(1) if isinstance(e, relax.Call) and getattr(e.op, "name", "") == op_name
        else None)
    return len(n)


def test_folded_transposes_are_not_emitted_and_numbers_match():
    from tvm import relax

    from lorac.compiler.passes.gemm import dispatch_gemms
    from lorac.runtime.engine import gemm as runtime_gemm

    mod, n, left = dispatch_gemms(_module())
    assert n == 3 and len(left) == 1 and "int32" in left[0]
    assert relax.analysis.check_well_formed(mod)
    assert _count(mod, "relax.permute_dims") == 2  # vt and jt; wt and the inline x^T folded
    assert _count(mod, "relax.matmul") == 1

    runtime_gemm.register()
    rng = np.random.default_rng(0)
    x, w, v = (rng.standard_normal(s).astype("float32") for s in ((4, 8), (6, 8), (8, 6)))
    i, j = (rng.integers(-3, 4, s).astype("int32") for s in ((4, 8), (6, 8)))
    ex = tvm.compile(mod, tvm.target.Target({"kind": "llvm"}))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    got = [t.numpy() for t in vm["main"](*(tvm.runtime.tensor(a) for a in (x, w, v, i, j)))]
    want = [x @ w.T, (2 * x) @ w.T, v.T @ x.T + v.T[:, :4], i @ j.T]
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_sums_of_gemms_become_one_accumulating_call():
    """compiler/passes/gemm_sum.py: (x W^T + u B^T) + z Vᵀ folds into one lorac.gemm_acc_ call when
    every GEMM result is read only by the sum; a GEMM read elsewhere too keeps its own call
    and its add; the numbers equal numpy's (the CPU path: first GEMM writes, others add)."""
    from tvm import relax

    from lorac.compiler.passes.gemm import dispatch_gemms
    from lorac.compiler.passes.gemm_sum import fuse_gemm_sums
    from lorac.runtime.engine import gemm as runtime_gemm

    bb = relax.BlockBuilder()
    f32 = "float32"
    names_shapes = (("x", (5, 8)), ("w", (6, 8)), ("u", (5, 3)), ("b", (6, 3)), ("z", (5, 4)), ("v", (6, 4)))
    args = [relax.Var(n, relax.TensorType(s, f32)) for n, s in names_shapes]
    x, w, u, b, z, v = args
    with bb.function("main", args):
        with bb.dataflow():
            mm_t = lambda p, q: bb.emit(relax.op.matmul(p, relax.op.permute_dims(q, [1, 0])))
            s1 = bb.emit(relax.op.add(mm_t(x, w), mm_t(u, b)))
            s2 = bb.emit(relax.op.add(s1, mm_t(z, v)))  # a chain folds into one call
            shared = mm_t(x, w)
            s3 = bb.emit(relax.op.add(shared, mm_t(u, b)))  # `shared` is also an output: no fold
            out = bb.emit_output(relax.Tuple([s2, s3, shared]))
        bb.emit_func_output(out)
    mod, _, _ = dispatch_gemms(bb.get())
    mod, names = fuse_gemm_sums(mod)
    assert names == ["lorac.gemm_acc_ntntnt"] and _count(mod, "relax.add") == 1
    runtime_gemm.register()
    runtime_gemm.register_accumulating(names)
    rng = np.random.default_rng(0)
    vals = [rng.standard_normal(s).astype(f32) for _, s in names_shapes]
    ex = tvm.compile(mod, tvm.target.Target({"kind": "llvm"}))
    got = [t.numpy() for t in relax.VirtualMachine(ex, tvm.cpu())["main"](*(tvm.runtime.tensor(a) for a in vals))]
    X, W, U, B, Z, V = vals
    for g, r in zip(got, (X @ W.T + U @ B.T + Z @ V.T, X @ W.T + U @ B.T, X @ W.T)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
