"""Activation offload (`--checkpointing offload`, graphs/ops/offload.py): checkpointed inputs wait in
host memory. The graph computes what plain checkpointing computes; the CUDA build maps the
units to the runtime's copies, and the plan no longer holds the inputs."""
from __future__ import annotations

import ctypes
import json
from dataclasses import replace

import numpy as np
import pytest

from _compiler_graphs import cuda_plan
from conftest import has_cuda_gpu
from lorac.graphs import ModelSpec, TrainSpec, build_training_graph
from lorac.graphs.spec import ALL_TARGETS

SPEC = ModelSpec(arch="qwen3", vocab=96, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=80,
                 qk_norm=True, tied=True)
TRAIN = TrainSpec(batch=2, seq=48, lora_targets=ALL_TARGETS, rank=4, alpha=8.0, checkpointing=True, keep_layers=1)


def _feeds(model, seed=0, spec=SPEC):
    import onnxruntime as ort
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {i.name: (rng.integers(0, spec.vocab, i.shape).astype(np.int64) if "int64" in i.type
                      else (0.1 * rng.standard_normal(i.shape)).astype(np.float32)) for i in sess.get_inputs()}
    return sess, feeds


def test_offloaded_graph_computes_what_checkpointing_computes():
    plain = build_training_graph(SPEC, TRAIN)
    off = build_training_graph(SPEC, replace(TRAIN, offload=True))
    units = [n.op_type for n in off.graph.node if n.domain]
    assert units.count("Offload") == units.count("Fetch") == 3  # layers 0-2 recomputed, layer 3 kept
    (s1, feeds), (s2, _) = _feeds(plain), _feeds(off)
    for a, b in zip(s1.run(None, feeds), s2.run(None, feeds)):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="needs checkpointing"):
        replace(TRAIN, checkpointing=False, keep_layers=0, offload=True).validate(SPEC)


def test_cuda_build_maps_offload_and_plans_without_the_inputs(tmp_path):
    from lorac.compiler import compile_graph
    model = build_training_graph(SPEC, replace(TRAIN, offload=True))
    art = compile_graph(model, target={"kind": "cuda", "cuda_graph": True}, out_dir=tmp_path / "a", dtype="bfloat16")
    m = json.loads((art / "manifest.json").read_text())
    assert {"Offload", "Fetch"} <= set(m["units"])
    calls = sorted((c["slot"], c["tensors"]) for c in m["unit_calls"] if c["function"] == "lorac.offload")
    assert calls == [(i, [{"shape": [TRAIN.batch * TRAIN.seq, SPEC.hidden], "dtype": "bfloat16"}]) for i in range(3)]
    # 12 layers, all recomputed: the plan drops by the inputs of all but the few live at its peak
    spec, big = replace(SPEC, layers=12), replace(TRAIN, batch=4, seq=256, keep_layers=0)
    plain = cuda_plan(build_training_graph(spec, big), "bfloat16", cuda_graph=True)["static_plan_bytes"]
    off = cuda_plan(build_training_graph(spec, replace(big, offload=True)), "bfloat16", cuda_graph=True)["static_plan_bytes"]
    per_layer = big.batch * big.seq * SPEC.hidden * 2  # one layer's bf16 input
    assert plain - off >= (spec.layers - 3) * per_layer, (plain, off, per_layer)


def test_the_estimate_counts_offload_and_auto_picks_it_when_it_must():
    from lorac.runtime.train import memory
    cfg = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=4, seq=2048, lora_targets=spec.targets, rank=16, alpha=32.0, loss_chunk=1024)
    full = replace(train, checkpointing=True)
    # the plans of compiled steps (bench: cuda_plan of this shape): 3.49 GB plain, 1.53 GB offloaded
    assert memory.plan_bytes(spec, full) == pytest.approx(3.49e9, rel=0.06)
    assert memory.plan_bytes(spec, replace(full, offload=True)) == pytest.approx(1.53e9, rel=0.06)
    n = 8 * 10 ** 9
    lean = memory.estimate(spec, full, n)
    tight = memory.choose(spec, train, n, "bfloat16", lean - 10 ** 9, "test", offload=True)
    assert tight.checkpointing and tight.offload
    assert not memory.choose(spec, train, n, "bfloat16", lean - 10 ** 9, "test").offload  # a device that cannot
    roomy = memory.choose(spec, train, n, "bfloat16", 200 * 10 ** 9, "test", offload=True)
    assert not roomy.checkpointing and not roomy.offload
    # a host that cannot pin the offloaded values: offload is passed over, and the line says so
    pinned = memory.offload_host(spec, replace(train, checkpointing=True, keep_layers=tight.keep_layers, offload=True),
                                 "bfloat16")
    small = memory.choose(spec, train, n, "bfloat16", lean - 10 ** 9, "test", offload=True, host=pinned - 1)
    assert small.offload and small.state_off  # the inputs alone, without the attention state, pin less
    none = memory.choose(spec, train, n, "bfloat16", lean - 10 ** 9, "test", offload=True, host=0)
    assert not none.offload and "offload passed over" in none.why
    assert memory.choose(spec, train, n, "bfloat16", lean - 10 ** 9, "test", offload=True, host=pinned).offload


LLAMA = ModelSpec(arch="llama", vocab=101, hidden=48, layers=3, heads=6, kv_heads=2, head_dim=8, intermediate=72,
                  tied=False)  # GQA 3, untied head


@pytest.mark.parametrize("spec,seq", [(SPEC, 48), (SPEC, 13), (LLAMA, 13)])
def test_offloaded_attention_state_computes_what_checkpointing_computes(spec, seq):
    """offload_state: the recomputed layers send q, k, v, the attention output and statistics (and
    Qwen3's q/k before their norms) and the residual sum after attention with their input, and
    their backward recomputes only the MLP half: the same loss and gradients bit for bit (CPU),
    with fewer nodes (no q/k/v or o_proj GEMMs, no RoPE, no attention forward in the backward)."""
    from lorac.graphs.compose import offloads_state
    train = replace(TRAIN, seq=seq)
    plain = build_training_graph(spec, train)
    state = replace(train, offload=True, offload_state=True)
    off = build_training_graph(spec, state)
    assert offloads_state(spec, state) and not offloads_state(spec, replace(state, offload_state=False))
    n_recomputed = spec.layers - 1
    calls = [n for n in off.graph.node if n.op_type == "Offload"]
    assert len(calls) == n_recomputed and all(len(n.input) == (11 if spec.qk_norm else 9) for n in calls)
    attention = lambda m: sum(n.op_type == "CausalAttention" for n in m.graph.node)
    assert attention(plain) == spec.layers + n_recomputed and attention(off) == spec.layers
    # o_proj's frozen weight read transposed by the forward's GEMM, plus by the recompute's in plain only
    o_fwd = lambda m: sum(n.op_type == "Transpose" and any("o_proj.weight" in i for i in n.input) for n in m.graph.node)
    assert o_fwd(plain) == o_fwd(off) + n_recomputed
    (s1, feeds), (s2, _) = _feeds(plain, spec=spec), _feeds(off, spec=spec)
    for a, b in zip(s1.run(None, feeds), s2.run(None, feeds)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("spec,seq", [(SPEC, 13), (LLAMA, 13)])
def test_kept_mlp_halves_compute_what_their_refill_computes(spec, seq):
    """keep_mlp: the highest recomputed layers keep gate and up from the forward, so their backward
    forms only the LoRA u of gate and up (no frozen gate/up GEMM, no B GEMM): the same loss and
    gradients bit for bit (CPU) as recomputing them."""
    state = replace(TRAIN, seq=seq, offload=True, offload_state=True, keep_layers=1)  # the top layer kept
    mlp = replace(state, keep_mlp=2)
    n = spec.layers
    assert [mlp.keeps_mlp(spec, i) for i in range(n)] == [i in (n - 3, n - 2) for i in range(n)]
    assert replace(mlp, keep_mlp=9).keeps_mlp(spec, 0) and not replace(mlp, keep_mlp=9).keeps_mlp(spec, n - 1)
    a, b = build_training_graph(spec, state), build_training_graph(spec, mlp)
    gate = lambda m: sum(n.op_type == "Transpose" and any("gate_proj.weight" in i for i in n.input)
                         for n in m.graph.node)
    assert gate(a) == gate(b) + 2  # two recomputes of gate's frozen GEMM fewer
    (s1, feeds), (s2, _) = _feeds(a, spec=spec), _feeds(b, spec=spec)
    for x, y in zip(s1.run(None, feeds), s2.run(None, feeds)):
        assert np.array_equal(x, y)
    with pytest.raises(ValueError, match="--keep-mlp keeps the MLP half"):
        replace(mlp, offload_state=False).validate(spec)
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        replace(mlp, keep_mlp=-1).validate(spec)


def test_state_offload_rule_picks_shapes_whose_copies_hide_behind_the_forward():
    """TrainSpec.offload_state None: the family's rule (bytes of the state a forward FLOP) picks it for
    Llama-3-8B and -70B shapes, not for Qwen3-0.6B's quick layers nor the test models; None is the
    default, False asks for the input alone."""
    from lorac.graphs.compose import offloads_state
    from lorac.runtime.train import memory
    llama = dict(model_type="llama", vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 tie_word_embeddings=False)
    l8 = ModelSpec.from_hf_config({**llama, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32})
    l70 = ModelSpec.from_hf_config({**llama, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                                    "num_attention_heads": 64})
    q06 = ModelSpec.from_hf_config(dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                        head_dim=128, tie_word_embeddings=True))
    on = replace(TRAIN, offload=True, offload_state=None)
    assert not offloads_state(l8, replace(on, offload_state=False)) and TrainSpec(1, 2).offload_state is None
    assert offloads_state(l8, on) and offloads_state(l70, on)
    assert not offloads_state(q06, on) and not offloads_state(SPEC, on)
    assert not offloads_state(l8, replace(on, offload=False))
    # two staging slots, shared by both directions, and the slot fetched ahead (runtime/devices/cuda/offload.py):
    # the input alone, or with the state
    big = replace(on, batch=4, seq=2048)
    assert memory.offload_staging(l8, replace(big, offload_state=False), "bfloat16") == 3 * 8192 * 4096 * 2
    assert memory.offload_staging(l8, big, "bfloat16") == 3 * 8192 * (2 * (2 * 4096 + 2 * 4096 + 2 * 1024) + 4 * 34)
    # pinned host memory: one slot a recomputed layer but the top one (28 of the 29 recomputed with 3 kept: the
    # top slot waits in staging), in the plan's log line
    kept3 = replace(big, checkpointing=True, keep_layers=3)
    host = memory.offload_host(l8, kept3, "bfloat16")
    assert host == 28 * 8192 * (2 * (2 * 4096 + 2 * 4096 + 2 * 1024) + 4 * 34)
    assert memory.offload_host(l8, replace(kept3, offload_state=False), "bfloat16") == 28 * 8192 * 4096 * 2
    assert memory.offload_host(l8, replace(kept3, keep_layers=31), "bfloat16") == 0
    assert memory.offload_host(l8, replace(kept3, offload=False), "bfloat16") == 0
    assert memory.describe(True, 3, 32, True, True, host).endswith(
        "their inputs and attention state offloaded to host memory (8.5 GB pinned)")


def test_offload_slot_layout_reads_old_and_new_manifest_entries():
    from lorac.runtime.devices.cuda.offload import slot_layout
    old = {"function": "lorac.offload", "slot": 0, "shape": [96, 64], "dtype": "bfloat16"}
    assert slot_layout(old) == ([(0, 96 * 64 * 2)], 96 * 64 * 2)
    new = {"function": "lorac.offload", "slot": 1,
           "tensors": [{"shape": [3, 5], "dtype": "bfloat16"}, {"shape": [2, 4, 48, 1], "dtype": "float32"}]}
    places, total = slot_layout(new)
    assert places == [(0, 30), (256, 1536)] and total == 256 + 1536  # each value at a 256-byte boundary


def test_cuda_build_moves_the_attention_state_and_skips_its_recompute(tmp_path):
    """bf16 CUDA: each offloaded slot lists its values (bf16 activations, fp32 statistics); the
    backward recomputes no attention forward, and cuDNN's backward reads the fetched bf16 values."""
    from lorac.compiler.pipeline import lower_to_relax
    from lorac.compiler.targets import cuda as target_cuda
    from lorac.compiler.units.offload import converters
    train = replace(TRAIN, offload=True, offload_state=True)
    mod, units, calls, _ = lower_to_relax(build_training_graph(SPEC, train), target_cuda, "bfloat16")
    slots = [c for c in calls if c["function"] == "lorac.offload"]
    N, (B, S) = TRAIN.batch * TRAIN.seq, (TRAIN.batch, TRAIN.seq)
    q, kv = [B, S, SPEC.heads, SPEC.head_dim], [B, S, SPEC.kv_heads, SPEC.head_dim]
    want = [([N, SPEC.hidden], "bfloat16"), (q, "bfloat16"), (kv, "bfloat16"), (kv, "bfloat16"), (q, "bfloat16"),
            ([B, SPEC.heads, S, 1], "float32"), (q, "bfloat16"), (kv, "bfloat16"), ([N, SPEC.hidden], "bfloat16"),
            ([N, 1], "float32"), ([N, 1], "float32")]
    assert len(slots) == 3 and all([(t["shape"], t["dtype"]) for t in c["tensors"]] == want for c in slots)
    text = mod["main"].script()
    assert text.count('"lorac.attention_fwd"') == SPEC.layers  # the forward's only
    # each call holds the values of the (up to) two slots before it, so the runtime copies those
    # out straight from the plan's memory (core/constants.py OFFLOAD_KEEP_ALIVE)
    import re
    args = [len(a.split(",")) for a in re.findall(r'"lorac\.offload\.\d+", \(([^)]*)\)', text)]
    assert args == [11, 22, 33] and all(c["keep_alive"] == 2 for c in slots), args
    # fetched one call ahead: the top slot's call (2) outputs its values and slot 1's tensors, slot 1's
    # call takes those and outputs slot 0's, slot 0's takes those and outputs its values (the last call)
    fetches = re.findall(r'"lorac\.fetch\.(\d+)", \(([^)]*)\), out_ty=\[?((?:R\.Tensor\([^)]*\), dtype="\w+"\)(?:, )?)+)', text)
    shape = [(int(slot), len([a for a in ins.split(",") if a.strip()]), out.count("R.Tensor")) for slot, ins, out in fetches]
    n = len(want)
    assert shape == [(2, 1, 2 * n), (1, 1 + n, n), (0, 1 + n, n)] and all(c["fetch_ahead"] for c in slots), shape
    assert converters("float32")["Offload"] is not None


@pytest.mark.gpu
@pytest.mark.parametrize("state", [False, True])
def test_offloaded_step_equals_the_checkpointed_step_on_the_gpu(tmp_path, state):
    """Copies only: the offloaded CUDA-graph step gives the checkpointed step's loss and
    gradients bit for bit, over several steps (replays of the captured graph); with the attention
    state offloaded too, the backward's refill reads the forward's own values."""
    assert has_cuda_gpu()
    from lorac.compiler import compile_graph
    from lorac.runtime import load_artifact
    outs = []
    for off in (False, True):
        model = build_training_graph(SPEC, replace(TRAIN, offload=off, offload_state=state if off else None))
        art = compile_graph(model, target={"kind": "cuda", "cuda_graph": True}, out_dir=tmp_path / str(off),
                            dtype="bfloat16")
        step = load_artifact(art, device="cuda")
        _, feeds = _feeds(model)
        outs.append([step(feeds) for _ in range(3)])
    for a, b in zip(*outs):
        for k in a:
            assert np.array_equal(a[k], b[k]), k


class _HostCuda:
    """cudart as the offload runtime calls it, on host memory: copies happen at once (no streams),
    so a test sees where each value goes and comes back from (runtime/devices/cuda/offload.py)."""

    def __init__(self):
        self.keep, self.copies = [], []

    def _buffer(self, ref, nbytes):
        buf = ctypes.create_string_buffer(nbytes)
        self.keep.append(buf)
        ref._obj.value = ctypes.addressof(buf)
        return 0

    def cudaHostAlloc(self, ref, nbytes, _flags):
        return self._buffer(ref, nbytes)

    def cudaMalloc(self, ref, nbytes):
        return self._buffer(ref, nbytes)

    def cudaMemcpyAsync(self, dst, src, nbytes, kind, _stream):
        self.copies.append(kind)
        ctypes.memmove(dst, src, nbytes)
        return 0

    def cudaEventCreateWithFlags(self, ref, _flags):
        ref._obj.value = len(self.keep) + 1
        self.keep.append(None)
        return 0

    def cudaStreamCreateWithFlags(self, ref, _flags):
        ref._obj.value = 99
        return 0

    def cudaEventRecord(self, *_):
        return 0

    def cudaStreamWaitEvent(self, *_):
        return 0


class _Tensor:
    def __init__(self, a):
        self.a, self.device = a, type("Dev", (), {"index": 0})()

    def data_ptr(self):
        return self.a.ctypes.data


@pytest.mark.parametrize("keep,ahead", [(2, True), (2, False), (0, False)])
def test_offload_runtime_moves_each_slots_values_out_and_back(monkeypatch, keep, ahead):
    """Several values a slot (the attention state: bf16 activations, fp32 statistics, odd sizes):
    each comes back from host memory into its own output, over a step's order (offloads
    ascending, fetches descending, one fetch ahead) and a second step through the same staging.
    keep=2 (core/constants.py OFFLOAD_KEEP_ALIVE): each call also holds the two slots before it, and
    the plan reuses a slot's memory once the call two later has run; all but the top three slots
    go to the host straight from their values. keep=0 (older artifacts): every slot through staging,
    its memory reused at once. ahead (compiler/units/offload.py fetch_ahead): each fetch call takes
    its slot's tensors from the call before and outputs the next slot's, which the host's copy fills
    directly; the plan may reuse no memory a live tensor holds, so each slot's tensors are fresh
    (zeros) until that copy; the top and lowest slots' calls output their values too."""
    from lorac.runtime.devices.cuda import offload as rt
    cuda = _HostCuda()
    monkeypatch.setattr(rt, "_rt", cuda)
    monkeypatch.setattr(rt, "_get_stream", lambda *_: 1)
    monkeypatch.setattr(rt, "_state", {})
    shapes = [([5, 7], "bfloat16", np.uint16), ([3, 1, 2], "float32", np.float32), ([129], "bfloat16", np.uint16)]
    slots = [0, 1, 2, 4, 5, 7]
    manifest = type("M", (), {"unit_calls": [
        {"function": rt.OFFLOAD, "slot": s, "tensors": [{"shape": sh, "dtype": d} for sh, d, _ in shapes],
         **({"keep_alive": keep} if keep else {}), **({"fetch_ahead": True} if ahead else {})} for s in slots]})()
    rt.prepare(manifest)
    # staging: two buffers, shared by both directions, each the size of the biggest slot (what memory.offload_staging counts)
    assert rt._state["staging_bytes"] == rt.slot_layout(manifest.unit_calls[0])[1]
    assert len(rt._state["staging"]) == 2
    rng = np.random.default_rng(0)
    for step in range(2):
        values = {s: [rng.integers(0, 60000, sh).astype(t) if t == np.uint16 else rng.standard_normal(sh).astype(t)
                      for sh, _, t in shapes] for s in slots}
        sent = []
        for s in slots:
            sent.append([_Tensor(v.copy()) for v in values[s]])
            held = [x for values_of in sent[-1 - keep:-1] for x in values_of] if keep else []
            rt._offloader(s)(*sent[-1], *held, None)
            for x in (sent[-1 - keep] if len(sent) > keep else []):  # the plan reuses the memory of a slot
                x.a[...] = 0                                          # no call holds any more
        for x in (x for values_of in sent for x in values_of):  # and after the forward, all of it
            x.a[...] = 0
        held = []
        for j, s in enumerate(reversed(slots)):
            fresh = lambda slot: [_Tensor(np.zeros_like(v)) for v in values[slot]]
            nxt = slots[-2 - j] if j + 1 < len(slots) else None
            if not ahead:
                outs = fresh(s)
                rt._fetcher(s)(None, *outs)
                got = outs
            else:
                own = fresh(s) if j == 0 or nxt is None else []
                dests = fresh(nxt) if nxt is not None else []
                rt._fetcher(s)(None, *held, *own, *dests)
                got, held = own or held, dests
            for o, v in zip(got, values[s]):
                assert np.array_equal(o.a, v), (step, s)
    # a slot's values: out to the host and back but the top slot's, which wait in staging; through staging
    # each value its own copy in and one copy of the slot out; straight out, each value its own copy
    n, direct = len(shapes), (len(slots) - rt.DIRECT_BEFORE_TOP if keep else 0)
    staged = len(slots) - direct
    assert cuda.copies.count(rt._D2H) == 2 * (direct * n + staged - 1)
    assert rt._state[7]["host"] is None and all(rt._state[s]["host"] for s in slots[:-1])
    # back: through staging, each value its own copy out of it; ahead, straight into the tensors
    # but the top slot's (from staging) and the lowest one's (to its own outputs)
    assert cuda.copies.count(rt._H2D) == 2 * (len(slots) - 1) * (n if ahead else 1)
    assert cuda.copies.count(rt._D2D) == 2 * (staged + (2 if ahead else len(slots))) * n


def test_offload_runtime_refuses_more_pinned_memory_than_the_host_has(monkeypatch):
    """Before any pinning: one line naming the bytes needed, the bytes available and the ways out."""
    from lorac.core.errors import LoracError
    from lorac.runtime.devices import cpu
    from lorac.runtime.devices.cuda import offload as rt
    cuda = _HostCuda()
    monkeypatch.setattr(rt, "_rt", cuda)
    monkeypatch.setattr(rt, "_state", {})
    manifest = type("M", (), {"unit_calls": [
        {"function": rt.OFFLOAD, "slot": s, "tensors": [{"shape": [1000, 1000], "dtype": "bfloat16"}]} for s in (0, 1, 2)]})()
    monkeypatch.setattr(cpu, "memory_free", lambda: 3_000_000)  # 2 slots of 2 MB pinned (the top one stays) need 4 MB
    with pytest.raises(LoracError, match=r"needs 0\.0 GB of pinned host memory.*--memory-budget") as e:
        rt.prepare(manifest)
    assert "\n" not in str(e.value) and cuda.keep == []  # nothing allocated
    monkeypatch.setattr(cpu, "memory_free", lambda: 10_000_000)
    monkeypatch.setattr(rt, "_get_stream", lambda *_: 1)
    rt.prepare(manifest)  # fits: allocated
    assert rt._state[0]["bytes"] == rt._state[1]["bytes"] == rt.slot_layout(manifest.unit_calls[0])[1] >= 2_000_000
