"""The bundled SmolLM2-135M-Instruct re-quantized as llama.cpp's `llama-quantize ... Q4_K_M` would
write it, for bench/gguf_resident.py (llama.cpp's tools are not installable here).

Each tensor of the bundled Q4_1 file is dequantized (gguf.quants) and written in the type
llama.cpp's llama_tensor_get_type picks for LLAMA_FTYPE_MOSTLY_Q4_K_M (src/llama-quant.cpp of the
llama.cpp in llama-cpp-python 0.3.36), with its fallback for rows that are not whole 256-value
blocks (Q4_K -> Q5_0, Q6_K -> Q8_0). For SmolLM2 (hidden 576, tied embeddings) that is:
  token_embd (the tied output)       Q8_0   (Q6_K; 576 columns)
  attn_q, attn_k, attn_output,
  ffn_gate, ffn_up                   Q5_0   (Q4_K; 576 columns)
  attn_v                             Q8_0 on use_more_bits layers (Q6_K), else Q5_0
  ffn_down (1536 columns)            Q6_K on use_more_bits layers, else Q4_K
  norms                              F32
K-quant blocks by lorac's numpy transcription of llama.cpp's reference quantizers
(runtime/model/quant/kquants.py), the others by gguf.quants.quantize. The source is Q4_1, so
this is a re-quantization: a model of the real shape and weights, not llama.cpp's own file of
the original bf16 weights (no imatrix).

    python bench/q4_k_m.py [FOLDER]     # writes FOLDER/SmolLM2-135M-Q4_K_M.gguf (default /tmp/lorac-bench)
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

FTYPE_Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, cols: int, n_layers: int) -> str:
    """llama.cpp's Q4_K_M type for tensor `name` (rows of `cols` values; tied embeddings)."""
    if name.endswith("norm.weight") or cols is None:
        return "F32"
    layer = int(name.split(".")[1]) if name.startswith("blk.") else None
    if name == "token_embd.weight":  # tied: quantized as the output tensor
        return "Q8_0" if cols % 256 else "Q6_K"
    kind = "Q4_K"
    if ".attn_v." in name and use_more_bits(layer, n_layers):
        kind = "Q6_K"
    if ".ffn_down." in name and use_more_bits(layer, n_layers):
        kind = "Q6_K"
    if cols % 256:
        kind = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[kind]
    return kind


def smollm2_q4_k_m(folder: Path) -> Path:
    """Write (once) and return folder/SmolLM2-135M-Q4_K_M.gguf."""
    import gguf

    from lorac.runtime.model.default import default_gguf_path
    from lorac.runtime.model.quant.gguf_blocks import quantize
    out = Path(folder) / "SmolLM2-135M-Q4_K_M.gguf"
    if out.exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(default_gguf_path())
    arch = reader.fields["general.architecture"].contents()
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(FTYPE_Q4_K_M)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # numpy order: [rows, cols]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        kind = q4_k_m_type(t.name, shape[-1] if len(shape) == 2 else None, n_layers)
        if kind == "F32":
            writer.add_tensor(t.name, w)
        else:
            writer.add_tensor(t.name, quantize(w, kind, t.name), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


if __name__ == "__main__":
    path = smollm2_q4_k_m(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/lorac-bench"))
    import gguf
    from collections import Counter
    r = gguf.GGUFReader(str(path))
    print(path, path.stat().st_size, dict(Counter(t.tensor_type.name for t in r.tensors)))
