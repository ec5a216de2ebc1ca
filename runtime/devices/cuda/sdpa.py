"""One cuDNN fused-attention graph (SDPA forward or backward), described for lorac's buffers and
built: the plans runtime/devices/cuda/attention.py registers and runs.

Buffers are token-major: q, o, do, dq [B, S, H, Dh] and k, v, dk, dv [B, S, K, Dh], which cuDNN
reads as [B, H, S, Dh] through strides (K < H: grouped-query attention, native in cuDNN).
Layouts (the `layout` argument):
  causal  plain rows, causal masking; stats [B, H, S, 1] fp32
  ragged  packed rows, each document a sequence of cuDNN's ragged (THD) layout (one group of
          runtime/devices/cuda/documents.py: capacity sequences of at most max_seq tokens,
          lengths and offsets bound to that group's buffers); causal masking inside each
          sequence; stats token-major [B, S, H, 1] at the same offsets
  bias    packed rows as plain rows plus an additive bias [B, 1, S, S] bf16 (0 where key j
          lies in query i's document, -1e30 before it: the CUDA build computes it from the
          position ids, compiler/targets/cuda/attention.py) and causal masking; stats
          [B, H, S, 1]. Every tile of the causal triangle is computed, as for plain rows, but
          those outside the band where `band` is given.
Options (attention.PACKED, from the measurements in bench/cudnn_isolated_check.py):
`deterministic` (the backward's use_deterministic_algorithm), `implementation` (the
forward's AUTO / COMPOSITE / UNIFIED), `engine` (the name of the plan to build instead of
the heuristics' first: the frontend's get_plan_name_at_index) and `band` (a left bound of the
causal band, diagonal_band_left_bound: keys that many positions or more before the query are
not computed; above the longest document of packed rows it changes no value).
"""
from __future__ import annotations

FWD_INPUTS = {"causal": ("q", "k", "v", "o", "lse"), "ragged": ("q", "k", "v", "o", "lse"),
              "bias": ("q", "k", "v", "bias", "o", "lse")}
BWD_INPUTS = {"causal": ("q", "k", "v", "o", "do", "lse", "dq", "dk", "dv"),
              "ragged": ("q", "k", "v", "o", "do", "lse", "dq", "dk", "dv"),
              "bias": ("q", "k", "v", "o", "do", "lse", "bias", "dq", "dk", "dv")}
# ways to ask for the causal mask, tried in order until a plan builds (frontend versions differ)
CAUSAL = ({"use_causal_mask": True}, {"diagonal_band_right_bound": 0, "diagonal_alignment": "TOP_LEFT"})


def bshd(B, S, H, Dh) -> tuple[list, list]:
    """cuDNN dims [B, H, S, Dh] with the strides of a token-major [B, S, H, Dh] buffer (with
    ragged offsets B counts sequences and each sequence's start comes from its offset)."""
    return [B, H, S, Dh], [S * H * Dh, Dh, H * Dh, 1]


def round64(n: int) -> int:
    return max(64, -(-n // 64) * 64)


class Plan:
    """One built cuDNN graph and the graph tensors its buffers bind to, in call order
    (`names`; ragged: also the group's lengths and offsets, bound once). `cudnn` is the
    frontend module, `handle` its handle."""

    def __init__(self, cudnn, handle, backward: bool, B: int, S: int, H: int, K: int, Dh: int, scale: float,
                 layout: str = "causal", docs=None, group: int = 0, options: dict | None = None):
        if layout not in FWD_INPUTS or (layout == "ragged") != (docs is not None):
            raise ValueError(f"attention plan: layout {layout!r} with{'' if docs is not None else 'out'} documents")
        self.c, self.handle, self.scale, self.layout = cudnn, handle, scale, layout
        self.backward, self.docs, self.group, self.options = backward, docs, group, dict(options or {})
        self.names = (BWD_INPUTS if backward else FWD_INPUTS)[layout]
        self.shapes = {"q": (B, S, H, Dh), "kv": (B, S, K, Dh), "bias": (B, 1, S, S),
                       "lse": (B, S, H, 1) if layout == "ragged" else (B, H, S, 1)}
        self.failed = []  # (causal spelling, cuDNN's error) of each spelling tried before the one built
        for causal in CAUSAL:
            try:
                self._build(B, S, H, K, Dh, causal)
                return
            except Exception as e:  # noqa: BLE001 - cuDNN raises its own error types; the first one is reported
                self.failed.append((causal, e))
        raise self.failed[0][1]

    def _build(self, B, S, H, K, Dh, causal) -> None:
        c, opt = self.c, self.options
        bf16, f32 = c.data_type.BFLOAT16, c.data_type.FLOAT
        self.causal = causal
        mask = {k: getattr(c.diagonal_alignment, v) if k == "diagonal_alignment" else v for k, v in causal.items()}
        ragged = self.layout == "ragged"
        group = self.docs.groups[self.group] if ragged else None
        n, L = (group.capacity, group.max_seq) if ragged else (B, S)  # cuDNN's batch and sequence length
        g = c.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)
        t = {"q": g.tensor(*bshd(n, L, H, Dh), data_type=bf16, name="q"),
             "k": g.tensor(*bshd(n, L, K, Dh), data_type=bf16, name="k"),
             "v": g.tensor(*bshd(n, L, K, Dh), data_type=bf16, name="v")}
        # stats [B, H, S, 1]; ragged: token-major [tokens, H] (each sequence's rows at its offset)
        lse_dims, lse_strides = [n, H, L, 1], ([L * H, 1, H, 1] if ragged else [H * L, L, 1, 1])
        bound, offsets = {}, {}
        if ragged:
            lens = [g.tensor([n, 1, 1, 1], [1, 1, 1, 1], data_type=c.data_type.INT32, name=f"seq_len_{x}") for x in "qk"]
            offsets = {m: g.tensor([n + 1, 1, 1, 1], [1, 1, 1, 1], data_type=c.data_type.INT64, name=f"ragged_{m}")
                       for m in sorted({H * Dh, K * Dh, H})}
            for name, m in (("q", H * Dh), ("k", K * Dh), ("v", K * Dh)):
                t[name].set_ragged_offset(offsets[m])
            mask.update(use_padding_mask=True, seq_len_q=lens[0], seq_len_kv=lens[1])
            lengths = self.docs.lengths[self.group]
            bound = {lens[0]: lengths, lens[1]: lengths, **{x: self.docs.offsets_of(self.group, m) for m, x in offsets.items()}}
        if opt.get("band"):
            mask["diagonal_band_left_bound"] = int(opt["band"])
        if self.layout == "bias":  # bf16 (the build's), or fp32 where options say (bench/cudnn_isolated_speed.py)
            dt = f32 if opt.get("bias_dtype") == "float32" else bf16
            t["bias"] = g.tensor([B, 1, S, S], [S * S, S * S, S, 1], data_type=dt, name="bias")
            mask["bias"] = t["bias"]
        if not self.backward:
            extra = {"implementation": getattr(c.attention_implementation, opt["implementation"])} \
                if opt.get("implementation") else {}
            o, lse = g.sdpa(t["q"], t["k"], t["v"], attn_scale=self.scale, is_inference=False, name="sdpa",
                            **mask, **extra)
            o.set_output(True).set_dim(bshd(n, L, H, Dh)[0]).set_stride(bshd(n, L, H, Dh)[1])
            lse.set_output(True).set_data_type(f32).set_dim(lse_dims).set_stride(lse_strides)
            if ragged:
                o.set_ragged_offset(offsets[H * Dh])
                lse.set_ragged_offset(offsets[H])
            t.update(o=o, lse=lse)
        else:
            t["o"] = g.tensor(*bshd(n, L, H, Dh), data_type=bf16, name="o")
            t["do"] = g.tensor(*bshd(n, L, H, Dh), data_type=bf16, name="do")
            t["lse"] = g.tensor(lse_dims, lse_strides, data_type=f32, name="lse")
            if ragged:
                for name, m in (("o", H * Dh), ("do", H * Dh), ("lse", H)):
                    t[name].set_ragged_offset(offsets[m])
                # the sizes of cuDNN's own accumulators (dq in fp32): the tokens, not sequences x max_seq
                T = round64(self.docs.B * self.docs.S)
                mask.update(max_total_seq_len_q=T, max_total_seq_len_kv=T)
            if opt.get("deterministic"):
                mask["use_deterministic_algorithm"] = True
            dq, dk, dv = g.sdpa_backward(t["q"], t["k"], t["v"], t["o"], t["do"], t["lse"], attn_scale=self.scale,
                                         name="sdpa_backward", **mask)
            for x, heads in ((dq, H), (dk, K), (dv, K)):
                x.set_output(True).set_dim(bshd(n, L, heads, Dh)[0]).set_stride(bshd(n, L, heads, Dh)[1])
                if ragged:
                    x.set_ragged_offset(offsets[heads * Dh])
            t.update(dq=dq, dk=dk, dv=dv)
        self._finish(g)
        self.graph, self.tensors = g, [t[name] for name in self.names]
        self.workspace = int(g.get_workspace_size())
        self.bound = {x: b.data_ptr() for x, b in bound.items()}

    def _finish(self, g) -> None:
        """Build the heuristics' first plan that builds, or the one named by options["engine"]."""
        c, engine = self.c, self.options.get("engine")
        if not engine:
            g.build([c.heur_mode.A, c.heur_mode.FALLBACK])
            return
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([c.heur_mode.A, c.heur_mode.FALLBACK])
        g.check_support()
        names = [g.get_plan_name_at_index(i) for i in range(g.get_execution_plan_count())]
        if engine not in names:
            raise ValueError(f"no cuDNN plan named {engine!r} for this graph (it has {names})")
        g.select_plan(names.index(engine))
        g.build_plans()

    def plan_names(self) -> list[str]:
        """The names of the plans cuDNN's heuristics offered for this graph."""
        return [self.graph.get_plan_name_at_index(i) for i in range(self.graph.get_execution_plan_count())]

    def run(self, buffers: list, workspace: int) -> None:
        self.graph.execute({**{x: b.data_ptr() for x, b in zip(self.tensors, buffers)}, **self.bound}, workspace,
                           handle=self.handle)
