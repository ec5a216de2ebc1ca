"""LoRA+ AdamW: numpy reference vs torch.optim.AdamW, schedule, groups; the ONNX optimizer
graph vs the reference on onnxruntime (and TVM's llvm build where TVM is installed)."""
import math

import numpy as np
import pytest

from lorac.runtime.train.optim import LoraPlusConfig, adamw_step_reference, clip_by_global_norm, group_lrs, group_of, init_state, lr_at

P = "base_model.model.model.layers.{i}.{mod}.lora_{ab}.weight"


def lora_tensors(rng, layers=2, r=4, d=16, ff=24):
    """A small LoRA set: q_proj (d->d), v_proj (d->d/2), down_proj (ff->d)."""
    out = {}
    for i in range(layers):
        for mod, din, dout in (("self_attn.q_proj", d, d), ("self_attn.v_proj", d, d // 2), ("mlp.down_proj", ff, d)):
            out[P.format(i=i, mod=mod, ab="A")] = rng.uniform(-1, 1, (r, din)).astype(np.float32) / math.sqrt(din)
            out[P.format(i=i, mod=mod, ab="B")] = (rng.standard_normal((dout, r)) * 0.01).astype(np.float32)
    return out


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def test_group_rule_follows_peft():
    assert group_of("x.q_proj.lora_B.weight") == "B"
    assert group_of("x.q_proj.lora_A.weight") == "A"
    assert group_of("x.norm.weight", ndim=1) == "B"  # PEFT: param.ndim == 1 -> group B


def test_schedule_warmup_cosine_floor():
    cfg = LoraPlusConfig(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(1, cfg) == pytest.approx(1e-4)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(0.55e-3)  # cosine midpoint: (lr + min_lr) / 2
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    assert lr_at(500, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert group_lrs(5, cfg) == (pytest.approx(5e-4), pytest.approx(5e-4 * 16))
    assert lr_at(3, LoraPlusConfig(lr=2e-4, warmup_steps=0, total_steps=1)) == pytest.approx(2e-5)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="not a finite number"):
        LoraPlusConfig(lr=float("nan"))
    with pytest.raises(ValueError, match="betas"):
        LoraPlusConfig(betas=(0.9, 1.0))


def test_reference_matches_torch_adamw_two_groups():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    params = lora_tensors(rng)
    cfg = LoraPlusConfig(lr=3e-3, loraplus_ratio=16, weight_decay=0.1, max_grad_norm=0.5,
                         warmup_steps=2, total_steps=8)
    tp = {k: torch.nn.Parameter(torch.tensor(p, dtype=torch.float64)) for k, p in params.items()}
    groups = [{"params": [tp[k] for k in tp if group_of(k) == "A"]},
              {"params": [tp[k] for k in tp if group_of(k) == "B"]}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    m, v = init_state(params)
    for step in range(1, 7):
        grads = {k: (rng.standard_normal(p.shape) * (0.05 if step % 2 else 2.0)).astype(np.float32)
                 for k, p in params.items()}  # odd steps unclipped, even steps clipped
        lr_a, lr_b = group_lrs(step, cfg)
        res = adamw_step_reference(params, grads, m, v, step, lr_a, lr_b, cfg)
        assert not res.skipped
        # torch: float64 master copies, the same clip, one lr per group
        for k, t in tp.items():
            t.grad = torch.tensor(grads[k], dtype=torch.float64)
        norm = torch.nn.utils.clip_grad_norm_(list(tp.values()), cfg.max_grad_norm)
        assert float(norm) == pytest.approx(res.grad_norm, rel=1e-9)
        opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = lr_a, lr_b
        opt.step()
        params, m, v = res.params, res.m, res.v
        for k, t in tp.items():
            assert rel_err(params[k], t.detach().numpy()) <= 1e-6, (step, k)
            st = opt.state[t]
            assert rel_err(m[k], st["exp_avg"].numpy()) <= 1e-6
            assert rel_err(v[k], st["exp_avg_sq"].numpy()) <= 1e-6


def test_reference_skips_nonfinite_and_clips():
    rng = np.random.default_rng(1)
    params = lora_tensors(rng, layers=1)
    m, v = init_state(params)
    grads = {k: np.ones_like(p) for k, p in params.items()}
    clipped, norm = clip_by_global_norm(grads, 1.0)
    assert norm == pytest.approx(math.sqrt(sum(p.size for p in params.values())))
    assert math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in clipped.values())) == pytest.approx(1.0, rel=1e-5)
    k0 = next(iter(grads))
    grads[k0] = grads[k0].copy()
    grads[k0][0, 0] = np.nan
    res = adamw_step_reference(params, grads, m, v, 1, 1e-3, 1e-2, LoraPlusConfig())
    assert res.skipped and not math.isfinite(res.grad_norm)
    for k in params:
        assert np.array_equal(res.params[k], params[k]) and not res.m[k].any() and not res.v[k].any()


# -- the ONNX optimizer graph ----------------------------------------------------------------
def _graph_run_ref(run, params, cfg, steps=6, seed=2):
    from lorac.graphs.optimizer import buckets, pack, unpack
    """Drive `run(feeds) -> outputs dict` and the reference side by side; compare each step.

    Steps: small grads (unclipped), large grads (clipped), a NaN step (skipped, step not
    advanced), an Inf step, then normal again."""
    rng = np.random.default_rng(seed)
    m, v = init_state(params)
    gp, gm, gv = dict(params), dict(m), dict(v)
    step, skipped_seen = 1, 0
    for i in range(steps):
        scale = [0.01, 3.0, 0.02, 5.0, 0.01, 0.5][i % 6]
        grads = {k: (rng.standard_normal(p.shape) * scale).astype(np.float32) for k, p in params.items()}
        k0 = next(iter(grads))
        if i == 2:
            grads[k0][0, 0] = np.nan
        if i == 3:
            grads[k0][-1, -1] = np.inf
        lr_a, lr_b = group_lrs(step, cfg)
        ref = adamw_step_reference(params, grads, m, v, step, lr_a, lr_b, cfg)
        bks = buckets({k: p.shape for k, p in params.items()})
        flat = lambda d, suffix: {f"{key}{suffix}": x for key, x in pack(bks, d).items()}
        feeds = {**flat(gp, ".param"), **flat(gm, ".m"), **flat(gv, ".v"), **flat(grads, ".grad"),
                 "lr_a": np.array(lr_a, np.float32), "lr_b": np.array(lr_b, np.float32),
                 "step": np.array(step, np.float32)}
        res = run(feeds)
        out = {"grad_norm": res["grad_norm"], "skipped": res["skipped"]}
        for suffix, new in ((".param.new", ".new"), (".m.new", ".m.new"), (".v.new", ".v.new")):
            per = unpack(bks, {b.key: res[b.key + suffix] for b in bks})
            out.update({f"{k}{new}": x for k, x in per.items()})
        assert bool(out["skipped"]) == ref.skipped, i
        if ref.skipped:
            skipped_seen += 1
            assert not math.isfinite(float(out["grad_norm"]))
        else:
            assert float(out["grad_norm"]) == pytest.approx(ref.grad_norm, rel=1e-6)
        for k in params:
            assert rel_err(out[f"{k}.new"], ref.params[k]) <= 1e-6, (i, k)
            assert rel_err(out[f"{k}.m.new"], ref.m[k]) <= 1e-6, (i, k)
            assert rel_err(out[f"{k}.v.new"], ref.v[k]) <= 1e-6, (i, k)
            if ref.skipped:  # bit-for-bit unchanged
                assert np.array_equal(out[f"{k}.new"], gp[k]) and np.array_equal(out[f"{k}.m.new"], gm[k])
        # both sides continue from their own state: errors would accumulate, not hide
        params, m, v = ref.params, ref.m, ref.v
        gp = {k: out[f"{k}.new"] for k in params}
        gm = {k: out[f"{k}.m.new"] for k in params}
        gv = {k: out[f"{k}.v.new"] for k in params}
        step += 0 if ref.skipped else 1
    assert skipped_seen == 2


GRAPH_CFG = LoraPlusConfig(lr=2e-3, weight_decay=0.05, max_grad_norm=1.0, warmup_steps=2, total_steps=10)


def test_optimizer_graph_matches_reference_on_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    from lorac.graphs.optimizer import build_optimizer_graph
    params = lora_tensors(np.random.default_rng(3))
    model = build_optimizer_graph({k: p.shape for k, p in params.items()}, GRAPH_CFG)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    _graph_run_ref(lambda feeds: dict(zip(names, sess.run(None, feeds))), params, GRAPH_CFG)


def test_optimizer_graph_without_clipping_or_decay():
    ort = pytest.importorskip("onnxruntime")
    from lorac.graphs.optimizer import build_optimizer_graph
    cfg = LoraPlusConfig(lr=1e-3, weight_decay=0.0, max_grad_norm=0.0, total_steps=10)
    params = lora_tensors(np.random.default_rng(4), layers=1)
    model = build_optimizer_graph({k: p.shape for k, p in params.items()}, cfg)
    ops = {n.op_type for n in model.graph.node}
    assert "Min" not in ops  # no clipping emitted
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    _graph_run_ref(lambda feeds: dict(zip(names, sess.run(None, feeds))), params, cfg, seed=5)


def test_optimizer_graph_ops_convert_in_tvm_and_match():
    """Every op is in TVM's ONNX converter map (the AdamWStep units inlined, as the CPU
    build does); the llvm build agrees with the reference."""
    pytest.importorskip("tvm")
    try:
        from tvm import relax
        from tvm.relax.frontend.onnx import from_onnx, onnx_frontend
    except ImportError:
        pytest.skip("TVM compiler library not available")
    import tvm
    from lorac.graphs.builder import inline_units
    from lorac.graphs.optimizer import build_optimizer_graph
    params = lora_tensors(np.random.default_rng(6), layers=1, d=8, ff=8, r=2)
    model = inline_units(build_optimizer_graph({k: p.shape for k, p in params.items()}, GRAPH_CFG))
    missing = {n.op_type for n in model.graph.node} - set(onnx_frontend._get_convert_map())
    assert not missing, missing
    mod = from_onnx(model, keep_params_in_input=False)
    in_names = [i.name for i in model.graph.input]
    out_names = [o.name for o in model.graph.output]
    vm = relax.VirtualMachine(tvm.compile(mod, tvm.target.Target({"kind": "llvm"})), tvm.cpu())

    def run(feeds):
        outs = vm["main"](*[tvm.runtime.tensor(np.asarray(feeds[n], dtype=np.float32)) for n in in_names])
        return {n: o.numpy() for n, o in zip(out_names, outs)}
    _graph_run_ref(run, params, GRAPH_CFG)


def test_feed_and_output_names_follow_the_graph():
    from lorac.graphs.optimizer import build_optimizer_graph, optimizer_feed_names, optimizer_output_names
    shapes = {P.format(i=0, mod="self_attn.q_proj", ab="A"): (2, 8), P.format(i=0, mod="self_attn.q_proj", ab="B"): (8, 2)}
    model = build_optimizer_graph(shapes, LoraPlusConfig())
    assert [i.name for i in model.graph.input] == optimizer_feed_names(shapes)
    assert [o.name for o in model.graph.output] == optimizer_output_names(shapes)


@pytest.mark.parametrize("cfg", [GRAPH_CFG, LoraPlusConfig(lr=1e-3, weight_decay=0.0, max_grad_norm=0.0,
                                                            warmup_steps=0, total_steps=10)],
                         ids=["clip-decay", "no-clip-no-decay"])
def test_in_place_adamw_kernel_matches_reference(cfg):
    """The AdamWStep unit mapped whole (compiler/units/adamw.py, its serial CPU form of the
    CUDA kernel): p, m and v are updated in place (the outputs are the inputs' memory), and
    six steps (clipped, unclipped, a NaN and an Inf step left bit for bit) match the reference."""
    pytest.importorskip("tvm")
    try:
        from tvm import relax
        from tvm.relax.frontend.onnx import from_onnx
    except ImportError:
        pytest.skip("TVM compiler library not available")
    import tvm

    from lorac.compiler.units.adamw import converters
    from lorac.compiler.units import anchor_outputs, frontend_with, split_units
    from lorac.graphs.optimizer import build_optimizer_graph
    params = lora_tensors(np.random.default_rng(7), layers=1, d=8, ff=8, r=2)
    native = converters(gpu=False)
    model, units = split_units(build_optimizer_graph({k: p.shape for k, p in params.items()}, cfg), native)
    assert units == ["AdamWStep"]
    with frontend_with({u: native[u] for u in units}):
        mod = from_onnx(anchor_outputs(model), keep_params_in_input=False)
    in_names = [i.name for i in model.graph.input if i.name not in {x.name for x in model.graph.initializer}]
    out_names = [o.name for o in model.graph.output]
    vm = relax.VirtualMachine(tvm.compile(mod, tvm.target.Target({"kind": "llvm"})), tvm.cpu())

    def run(feeds):
        args = {n: tvm.runtime.tensor(np.asarray(feeds[n], dtype=np.float32)) for n in in_names}
        outs = dict(zip(out_names, vm["main"](*args.values())))
        for n in in_names:
            if n.endswith((".param", ".m", ".v")):
                assert outs[n + ".new"].data_ptr() == args[n].data_ptr(), n  # in place
        return {n: o.numpy() for n, o in outs.items()}
    _graph_run_ref(run, params, cfg)


# -- the bias corrections 1 - b^t, on any device ------------------------------------------------
BETAS = (0.5, 0.9, 0.999, 0.99999)


def _bias_corrections(n: int, device_like: bool = False):
    """The optimizer's 1 - b^t (graphs/optimizer._one_minus_pow) for t = 1..n and each of BETAS
    on onnxruntime's CPU provider -> (t, [outputs]). device_like: every Exp off by (3 + 2|x|)
    ulp and every Log by 2^-21 absolute, the accuracy Vulkan (and so WebGPU) allows
    (GLSL.std.450 exp, log on [0.5, 2]); NVIDIA's approximate exp2/log2 are within it."""
    ort = pytest.importorskip("onnxruntime")
    from lorac.graphs import builder
    from lorac.graphs.optimizer import _one_minus_pow

    class Device(builder.GraphBuilder):
        def op(self, op_type, *inputs, **kw):
            y = super().op(op_type, *inputs, **kw)
            if device_like and op_type == "Exp":
                ulps = super().op("Add", super().op("Mul", super().op("Abs", inputs[0]), self.f(2.0 ** -22)),
                                  self.f(1 + 3 * 2.0 ** -23))
                y = super().op("Mul", y, ulps)
            elif device_like and op_type == "Log":
                y = super().op("Add", y, self.f(2.0 ** -21))
            return y
    g = Device("bias_corrections")
    t = g.input("t", [n])
    for i, b in enumerate(BETAS):
        g.output(_one_minus_pow(g, b, t), f"bc{i}")
    model = g.finish("1 - b^t", data_prop=False)
    steps = np.arange(1, n + 1, dtype=np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return steps, sess.run(None, {"t": steps}), model


def _worst(steps, outs) -> float:
    return max(float(np.max(np.abs(o - ref) / ref)) for o, ref in
               ((o, -np.expm1(steps.astype(np.float64) * math.log(b))) for o, b in zip(outs, BETAS)))


def test_bias_correction_is_exact_on_onnxruntime():
    """1 - b^t to 2e-7 relative for t = 1..200000 (the plain form, 1 - b**t in float32, is off
    by 1.3e-5 at b = 0.999, t = 1)."""
    steps, outs, model = _bias_corrections(200_000)
    assert _worst(steps, outs) <= 2e-7
    assert "Log" not in {n.op_type for n in model.graph.node}


def test_bias_correction_holds_with_a_gpus_exp_and_log():
    """With exp and log as inexact as Vulkan/WebGPU allow, 1 - b^t stays within 6e-7: it uses
    no log (Kahan's expm1 form, (u - 1) q / log(u), lost 4.8e-4 at b = 0.999 and 5 % at
    b = 0.99999, t = 1, so; on the H200 through WebGPU 20 steps drifted 4.1e-4 from the CPU)."""
    steps, outs, _ = _bias_corrections(200_000, device_like=True)
    assert _worst(steps, outs) <= 6e-7
