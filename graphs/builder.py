"""A thin emitter over onnx-ir: `g.op("MatMul", a, b)` appends a node and returns its value.

onnx-ir (the IR under onnxscript) is a well-kept in-memory ONNX representation; lorac adds
only what every emitter needs: unique node names (onnxruntime's optimizer rejects
duplicates), de-duplicated constants, *units* (a call of an ONNX local function in the
lorac domain, whose body is default-domain ops: `call`), and a `finish` that runs shape
inference and the full checker, so every graph that leaves lorac.graphs has static shapes
on every value.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

OPSET = 18  # highest opset both TVM 0.27's frontend and onnxruntime 1.19 handle fully
IR_VERSION = 9  # onnxruntime-training 1.19 reads IR <= 10
DOMAIN = "lorac"  # the domain of lorac's units (local functions); version 1

FLOAT = ir.DataType.FLOAT
INT64 = ir.DataType.INT64
INT32 = ir.DataType.INT32  # index math WebGPU can run (it has no 64-bit integers)
BOOL = ir.DataType.BOOL


class GraphBuilder:
    """Collects nodes in emission order (a valid topological order) and graph inputs."""

    def __init__(self, name: str, dtype=np.float32):
        self.name = name
        self.np_float = np.dtype(dtype)  # float32 normally; float64 for finite-difference checks
        self.float = ir.DataType.from_numpy(self.np_float)
        self.nodes: list[ir.Node] = []
        self.inputs: list[ir.Value] = []
        self.outputs: list[ir.Value] = []
        self.initializers: list[ir.Value] = []
        self._consts: dict[tuple, ir.Value] = {}
        self._count = 0
        self.scope = ""  # prefix for node names, e.g. "L3.fwd"
        self.functions: dict[tuple, ir.Function] = {}  # (domain, name) -> the unit's body

    # -- values -------------------------------------------------------------------------
    def input(self, name: str, shape, dtype=None) -> ir.Value:
        dtype = self.float if dtype is None else dtype
        v = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(list(shape)))
        self.inputs.append(v)
        return v

    def const(self, array, dtype=None) -> ir.Value:
        """A constant, shared between all users of the same value."""
        arr = np.asarray(array, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self._new_const(arr)
        return self._consts[key]

    def _new_const(self, arr: np.ndarray) -> ir.Value:
        """A graph's constants are initializers."""
        v = ir.Value(name=f"c{len(self._consts)}", type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                     shape=ir.Shape(list(arr.shape)), const_value=ir.tensor(arr))
        self.initializers.append(v)
        return v

    def f(self, x: float) -> ir.Value:
        """A scalar constant of the graph's float type."""
        return self.const(self.np_float.type(x))

    def fconst(self, array) -> ir.Value:
        """An array constant of the graph's float type."""
        return self.const(np.asarray(array, dtype=self.np_float))

    def ints(self, *xs: int) -> ir.Value:
        """A 1-D int64 constant (shapes, axes, slice bounds)."""
        return self.const(np.array(xs, dtype=np.int64))

    # -- nodes --------------------------------------------------------------------------
    def op(self, op_type: str, *inputs, n_out: int = 1, domain: str = "", **attrs):
        self._count += 1
        name = f"{self.scope}/{op_type}_{self._count}" if self.scope else f"{op_type}_{self._count}"
        node = ir.Node(domain, op_type, list(inputs), attributes=_attrs(attrs), num_outputs=n_out, name=name)
        for i, out in enumerate(node.outputs):
            out.name = f"{name}:{i}"
        self.nodes.append(node)
        return node.outputs[0] if n_out == 1 else tuple(node.outputs)

    def call(self, name: str, variant: str, inputs: list, n_out: int, body, **attrs):
        """A unit: one node calling the local function (lorac, name), whose body
        `body(fb, *params) -> outputs` is emitted once with a FunctionBuilder. The checker
        and any ONNX runtime inline the body; a compiler may map the unit whole to a kernel
        of its own (lorac.compiler.units). `variant` names what the body bakes in (shapes,
        dtype; values that may vary are inputs): a graph holds one variant of each unit
        (IR 9 has no function overloads). `attrs` (ints) travel on the call node for such
        a compiler (the body has them baked in); the function declares them. The body's
        nodes are named `<name>/...`, so inlined copies still say which unit they came from."""
        key = (DOMAIN, name)
        if key not in self.functions:
            fb = FunctionBuilder(name, self.np_float)
            fb.scope = name
            params = [fb.param(f"in{i}") for i in range(len(inputs))]
            outs = body(fb, *params)
            outs = [outs] if isinstance(outs, ir.Value) else list(outs)
            self.functions[key] = ir.Function(
                DOMAIN, name, attributes=[_attr(k, v) for k, v in attrs.items()],
                graph=ir.Graph(params, [fb.op("Identity", o) for o in outs], nodes=fb.nodes,
                               opset_imports={"": OPSET}, name=name, doc_string=variant))
        elif self.functions[key].doc_string != variant:
            raise ValueError(f"unit {name}: variant {variant} in a graph that already has {self.functions[key].doc_string}")
        return self.op(name, *inputs, n_out=n_out, domain=DOMAIN, **attrs)

    def output(self, value: ir.Value, name: str) -> ir.Value:
        """Expose `value` under `name`; an Identity keeps graph inputs and outputs distinct."""
        out = self.op("Identity", value)
        out.name = name
        self.outputs.append(out)
        return out

    # -- common shapes of ops (pure sugar over `op`) ------------------------------------
    def matmul(self, a, b):
        return self.op("MatMul", a, b)

    def mm_t(self, a, b):
        """a @ b^T for 2-D b (HF weights are [out, in])."""
        return self.op("MatMul", a, self.op("Transpose", b, perm=[1, 0]))

    def add_all(self, *xs):
        """x1 + x2 + ... as a chain of Adds (TVM's frontend turns ONNX Sum into stack + sum,
        a copy of every term; a chain fuses, and one over GEMM results becomes a single
        accumulating GEMM: compiler/passes/gemm_sum.py)."""
        out = xs[0]
        for x in xs[1:]:
            out = self.op("Add", out, x)
        return out

    def reshape(self, x, *shape: int):
        return self.op("Reshape", x, self.ints(*shape))

    def transpose(self, x, *perm: int):
        return self.op("Transpose", x, perm=list(perm))

    def reduce_sum(self, x, *axes: int, keepdims: int = 1):
        return self.op("ReduceSum", x, self.ints(*axes), keepdims=keepdims)

    def reduce_mean(self, x, *axes: int, keepdims: int = 1):
        return self.op("ReduceMean", x, self.ints(*axes), keepdims=keepdims)

    def kept(self, x):
        """x unchanged, as a sum over a new axis of length 1: a reduction, which TVM's FuseOps
        ends a kernel at (it fuses only elementwise ops after a reduction), so x is written
        once instead of recomputed inside every reader it would fuse into."""
        return self.op("ReduceSum", self.op("Unsqueeze", x, self.ints(-1)), self.ints(-1), keepdims=0)

    def slice(self, x, start: int, end: int, axis: int):
        return self.op("Slice", x, self.ints(start), self.ints(end), self.ints(axis))

    # -- finish -------------------------------------------------------------------------
    def finish(self, doc: str = "", data_prop: bool = True, metadata: dict | None = None) -> onnx.ModelProto:
        """The checked model, with `metadata` as its metadata_props (hints to the compiler).
        data_prop=False for a graph of long 1-D vectors (the optimizer's): ONNX's data
        propagation keeps a 1-D tensor's values as a shape, ~1 KB per element (2.6 GB for 2M
        elements; an 8B adapter's optimizer graph ran the host out of memory)."""
        opsets = {"": OPSET, **({DOMAIN: 1} if self.functions else {})}
        graph = ir.Graph(self.inputs, self.outputs, nodes=self.nodes, initializers=self.initializers,
                         opset_imports=opsets, name=self.name, doc_string=doc or None)
        proto = ir.to_proto(ir.Model(graph, ir_version=IR_VERSION, producer_name="lorac",
                                     functions=list(self.functions.values())))
        proto.graph.ClearField("value_info")
        onnx.helper.set_model_props(proto, dict(metadata or {}))
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True, data_prop=data_prop)
        onnx.checker.check_model(proto, full_check=True)
        return proto


class FunctionBuilder(GraphBuilder):
    """Emits a unit's body: constants become Constant nodes (a function has no
    initializers), inputs are the function's parameters."""

    def param(self, name: str) -> ir.Value:
        v = ir.Value(name=name)
        self.inputs.append(v)
        return v

    def _new_const(self, arr: np.ndarray) -> ir.Value:
        return self.op("Constant", value=ir.tensor(arr))


def _attr(k: str, v):
    if isinstance(v, ir.Tensor):
        return ir.AttrTensor(k, v)
    if isinstance(v, float):
        return ir.AttrFloat32(k, v)
    if isinstance(v, bool):
        return ir.AttrInt64(k, int(v))
    if isinstance(v, int):
        return ir.AttrInt64(k, v)
    if isinstance(v, (list, tuple)):
        return ir.AttrInt64s(k, [int(i) for i in v])
    if isinstance(v, str):
        return ir.AttrString(k, v)
    raise TypeError(f"attribute {k}={v!r}")


def _attrs(attrs: dict) -> dict:
    return {k: _attr(k, v) for k, v in attrs.items()}


def inline_units(model: onnx.ModelProto, keep: tuple[str, ...] = ()) -> onnx.ModelProto:
    """`model` with every unit call replaced by its body, except units named in `keep`
    (those stay calls, for a compiler that maps them whole). Plain ONNX results: what
    autodiff tools and frontends that read only the default domain need."""
    from onnx import inliner

    ids = [(f.domain, f.name) for f in model.functions if f.name not in keep]
    if not ids:
        return model
    out = inliner.inline_selected_functions(model, ids, exclude=False)
    if not keep:
        del out.opset_import[:]
        out.opset_import.extend(i for i in model.opset_import if i.domain != DOMAIN)
    return out
