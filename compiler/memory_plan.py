"""One arena for a step's planned tensors, each at an offset chosen by its lifetime.

TVM's StaticPlanBlockMemory gives every planned tensor a storage token and reuses a freed
token only for a tensor of the same dtype and a similar size (TokenAllocatorMixed: a pool
per dtype, a token grown when a larger tensor takes it). In a bf16 training step the fp32
residuals and bf16 GEMM outputs then never share memory, and grown tokens hold their
largest tenant for the whole step: a Llama-3-8B-shape layer planned 1.13 GB where 0.91 GB
are live at once, and the checkpointed step's working set 2.7 GB where 1.4 GB are.

This pass runs right after it and keeps its lifetimes but not its tokens: every tensor it
placed (`memory.alloc_tensor` on a planned storage) is live from its allocation to the
last binding that reads it or any view of it (reshapes, variable copies, tuples), and is
placed into one byte arena by greedy-by-size offset assignment (largest first, at the
lowest offset where it overlaps no placed tensor that is live at the same time), each
offset a multiple of 256 bytes. The planned storages become that one allocation. A
function whose storages are not all static, global and on one device keeps TVM's plan.

Only for targets whose device API does pointer arithmetic on the host (a target module's
ARENA_PLAN: CPU, aarch64, CUDA), where TVM's ensure_zero_offset makes a view; elsewhere
it would copy the tensor, and those targets keep TVM's plan.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .passes.rewrite import with_blocks

ALIGN = 256
_ALLOC_STORAGE = "relax.memory.alloc_storage"
_ALLOC_TENSOR = "relax.memory.alloc_tensor"


def _op(value) -> str:
    return value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else ""


def _const_int(e) -> int | None:
    v = getattr(e, "value", None)
    if isinstance(v, tvm.tirx.IntImm):
        return int(v)
    return int(v) if isinstance(v, int) else None


def _vars_in(expr) -> list:
    """The variables `expr` reads (a binding's value has no bindings of its own inside)."""
    return list(relax.analysis.free_vars(expr))


def _storage_bytes(call) -> int | None:
    """Bytes of a static, global alloc_storage on device 0; None for anything else."""
    size, device, scope = call.args[0], call.args[1], call.args[2]
    if not isinstance(size, relax.ShapeExpr) or len(size.values) != 1:
        return None
    n = size.values[0]
    if not isinstance(n, tvm.tirx.IntImm) or _const_int(device) != 0 or getattr(scope, "value", None) != "global":
        return None
    return int(n)


def _tensor_bytes(ty) -> int | None:
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    n = 1
    for d in ty.shape.values:
        if not isinstance(d, tvm.tirx.IntImm):
            return None
        n *= int(d)
    return n * ((tvm.DataType(ty.dtype).bits + 7) // 8)


def lifetimes(bindings: list, result) -> tuple[dict, dict, dict] | None:
    """For each tensor placed on a planned storage (its binding's var): (bytes, first
    binding index, last binding index that reads it or a view of it). None when a planned
    storage is not static/global/device 0, or a placed tensor has no static size."""
    storages, size, first, last = set(), {}, {}, {}
    holds: dict = {}  # var -> the placed tensors whose memory it may refer to
    for i, b in enumerate(bindings):
        v, op = b.value, _op(b.value)
        refs = _vars_in(v)
        if op != _ALLOC_TENSOR and storages.intersection(refs):
            return None  # a storage read by anything else than a tensor placed on it
        for r in refs:
            for t in holds.get(r, ()):
                last[t] = i
        if op == _ALLOC_STORAGE:
            if _storage_bytes(v) is None:
                return None
            storages.add(b.var)
        elif op == _ALLOC_TENSOR and v.args[0] in storages:
            n = _tensor_bytes(b.var.ty)
            if n is None or _const_int(v.args[1]) != 0:
                return None
            size[b.var], first[b.var], last[b.var] = n, i, i
            holds[b.var] = (b.var,)
        elif not isinstance(v, relax.Call) or op in ("relax.reshape", "relax.memory.view",
                                                      "relax.memory.ensure_zero_offset"):
            # a copy of a variable, a tuple or its item, a view: the same memory
            held = {t for r in refs for t in holds.get(r, ())}
            if held:
                holds[b.var] = tuple(held)
    for r in _vars_in(result):
        for t in holds.get(r, ()):
            last[t] = len(bindings)
    return size, first, last


def assign_offsets(size: dict, first: dict, last: dict) -> tuple[dict, int]:
    """Greedy by size: -> ({tensor: byte offset}, arena bytes)."""
    order = sorted(size, key=lambda t: (-size[t], first[t]))
    lo = np.empty(len(order), np.int64)
    hi = np.empty(len(order), np.int64)
    start = np.empty(len(order), np.int64)
    end = np.empty(len(order), np.int64)
    offset, total = {}, 0
    for k, t in enumerate(order):
        n = -(-size[t] // ALIGN) * ALIGN
        live = (start[:k] <= last[t]) & (end[:k] >= first[t])
        at = 0
        if live.any():  # the lowest gap of n bytes between the live tensors' ranges
            a, b = lo[:k][live], hi[:k][live]
            by = np.argsort(a, kind="stable")
            a, reach = a[by], np.maximum.accumulate(b[by])  # reach: the end of everything before
            before = np.concatenate(([0], reach[:-1]))
            fits = np.nonzero(a - before >= n)[0]
            at = int(before[fits[0]]) if fits.size else int(reach[-1])
        offset[t] = at
        lo[k], hi[k], start[k], end[k] = at, at + n, first[t], last[t]
        total = max(total, at + n)
    return offset, total


def arena_plan(func: relax.Function) -> relax.Function:
    blocks = list(func.body.blocks)
    bindings = [b for blk in blocks for b in blk.bindings]
    found = lifetimes(bindings, func.body.body)
    if not found or not found[0]:
        return func
    size, first, last = found
    offset, total = assign_offsets(size, first, last)
    arena = relax.Var("lorac_arena", relax.ObjectType())
    placed = False
    new_blocks = []
    for blk in blocks:
        out = []
        for b in blk.bindings:
            op = _op(b.value)
            if op == _ALLOC_STORAGE:
                if not placed:  # the first planned storage's place: the arena
                    out.append(relax.VarBinding(arena, relax.op.memory.alloc_storage(
                        relax.ShapeExpr([total]), 0, "global", "uint8")))
                    placed = True
                continue
            if b.var in offset:
                c = b.value
                at = relax.op.memory.alloc_tensor(arena, offset[b.var], c.args[2], c.args[3], c.args[4])
                if offset[b.var] == 0:
                    out.append(relax.VarBinding(b.var, at))
                    continue
                # the VM makes a tensor at an offset as (storage base, byte_offset), and TVM's
                # kernels read only the base; ensure_zero_offset moves the offset into the
                # pointer (a view, on devices with pointer arithmetic on the host: ARENA_PLAN)
                raw = relax.Var(b.var.name + "_at", b.var.ty)
                out.append(relax.VarBinding(raw, at))
                out.append(relax.VarBinding(b.var, relax.op.memory.ensure_zero_offset(raw)))
                continue
            out.append(b)
        new_blocks.append(type(blk)(out))
    return with_blocks(func, new_blocks)


@tvm.transform.module_pass(opt_level=0, name="LoracArenaPlan")
def ArenaPlan(mod, _ctx):  # noqa: N802 - a pass, named as TVM names them
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = arena_plan(func)
    return relax.transform.Normalize()(mod)  # types of the new calls, for the passes after
