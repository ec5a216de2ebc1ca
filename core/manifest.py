"""An artifact's manifest.json as one record: written by the compiler (compiler/pipeline.py,
compiler/manifest.py), read by the runtime (runtime/engine/artifact.py, runtime/devices/).

On disk it stays the JSON object it always was, field for field and in the same order
(`Manifest.to_json`), so artifacts built before the record existed load as they are; the
seal and the file checksums (artifact_cache.verify) are checked on that JSON before a
Manifest is made of it. The fields (docs/COMPILER.md has the full table):

    format, format_version      "lorac-artifact", 2
    graph_sha256, target, dtype, tune
                                what was built (compiler/manifest.BuildRequest); `target` is
                                a Target: {"family", "request", "device", "tvm"}
    lorac_version, tvm_version, lorac_source
                                who built it (core/keys.versions): `built_by`
    library                     file name of the compiled module in the directory
    inputs / outputs            the signature in call order: [{"name", "shape", "dtype", ...}],
                                "name" the ONNX name, "relax_name" the frontend's parameter
    gemm                        {"dispatched": n, "left_to_tvm": [...], "accumulating": [...]}
    units, unit_calls           the fused units mapped whole, and the distinct calls they make
    bound_inputs                CUDA-graph builds: the step owns one buffer per input
    memory                      {"static_plan_bytes": n, ...}: the static memory plan
    extra                       per-target fields (e.g. the CUDA fatbin file)
    compile_seconds             {"import", "build", "export"}
    files, manifest_sha256      the sha256 of every other file, and the seal
"""
from __future__ import annotations

from dataclasses import dataclass, field

FORMAT = "lorac-artifact"
FORMAT_VERSION = 2  # 2: files and manifest_sha256 (entries of version 1 are rebuilt)


@dataclass(frozen=True)
class Target:
    family: str  # the compiler target family ("cpu", "cuda", ...)
    request: dict  # the target request the cache key holds ({"kind": family, ...})
    device: str  # the runtime device that runs it (runtime/devices/)
    tvm: dict = field(default_factory=dict)  # the TVM target as JSON

    @classmethod
    def from_json(cls, d) -> Target:
        d = d if isinstance(d, dict) else {}
        return cls(d.get("family"), d.get("request"), d.get("device"), d.get("tvm") or {})

    def to_json(self) -> dict:
        return {"family": self.family, "request": self.request, "device": self.device, "tvm": self.tvm}


# the fields in the order they are written (built_by's go after `tune`)
_FIELDS = ("format", "format_version", "graph_sha256", "target", "dtype", "tune")
_REST = ("library", "inputs", "outputs", "gemm", "units", "bound_inputs", "unit_calls", "memory", "extra",
         "compile_seconds", "files", "manifest_sha256")


@dataclass(frozen=True)
class Manifest:
    graph_sha256: str
    target: Target
    dtype: str  # compute dtype of frozen weights and GEMMs: "float32" | "bfloat16"
    library: str
    inputs: list  # [{"name", "shape", "dtype", "relax_name"}] in call order
    outputs: list  # [{"name", "shape", "dtype"}]
    tune: int = 0  # MetaSchedule trials
    built_by: dict = field(default_factory=dict)  # lorac_version, tvm_version, lorac_source
    gemm: dict = field(default_factory=dict)
    units: list = field(default_factory=list)
    bound_inputs: bool = False
    unit_calls: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    compile_seconds: dict = field(default_factory=dict)
    files: dict | None = None  # set when written (compiler/manifest.write)
    manifest_sha256: str | None = None
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def accumulating(self) -> list:
        """The accumulating GEMM functions the library calls (runtime/engine/gemm.py)."""
        return list(self.gemm.get("accumulating", []))

    @property
    def static_plan_bytes(self) -> int:
        """Bytes of the step's static memory plan (activations and workspace)."""
        return int(self.memory.get("static_plan_bytes", 0))

    def key_fields(self) -> dict:
        """What the build's cache key holds (compiler/manifest.cache_key): the BuildRequest's
        fields, the target as requested, and who built it."""
        return {"graph_sha256": self.graph_sha256, "target": self.target.request, "dtype": self.dtype,
                "tune": self.tune, **self.built_by}

    @classmethod
    def from_json(cls, d: dict) -> Manifest:
        """The record of a manifest.json object (verified before: artifact_cache.verify); a
        field an older artifact lacks takes its default."""
        known = set(_FIELDS) | set(_REST)
        get = lambda k, default: d[k] if d.get(k) is not None else default  # noqa: E731
        return cls(graph_sha256=d.get("graph_sha256"), target=Target.from_json(d.get("target")),
                   dtype=d.get("dtype"), library=d.get("library"), inputs=get("inputs", []),
                   outputs=get("outputs", []), tune=get("tune", 0),
                   built_by={k: v for k, v in d.items() if k not in known}, gemm=get("gemm", {}),
                   units=get("units", []), bound_inputs=bool(d.get("bound_inputs", False)),
                   unit_calls=get("unit_calls", []), memory=get("memory", {}), extra=get("extra", {}),
                   compile_seconds=get("compile_seconds", {}), files=d.get("files"),
                   manifest_sha256=d.get("manifest_sha256"), format=d.get("format"),
                   format_version=d.get("format_version"))

    def to_json(self) -> dict:
        """The manifest.json object, fields in their written order (files and the seal only
        once written)."""
        out = {"format": self.format, "format_version": self.format_version, "graph_sha256": self.graph_sha256,
               "target": self.target.to_json(), "dtype": self.dtype, "tune": self.tune, **self.built_by,
               "library": self.library, "inputs": self.inputs, "outputs": self.outputs, "gemm": self.gemm,
               "units": self.units, "bound_inputs": self.bound_inputs, "unit_calls": self.unit_calls,
               "memory": self.memory, "extra": self.extra, "compile_seconds": self.compile_seconds}
        if self.files is not None:
            out["files"] = self.files
        if self.manifest_sha256 is not None:
            out["manifest_sha256"] = self.manifest_sha256
        return out
