"""`lorac export --format onnx`: a model's training, eval or forward graph as an .onnx file,
to open in Netron or run in any ONNX runtime (the graph lorac compiles, before compiling).

The graphs take the frozen weights and the LoRA tensors as inputs, never initializers
(docs/GRAPHS.md): feed `input_ids` (int64 [batch, seq]), `labels` (train/eval; -100 where a
token does not count), every weight under its HF name and every LoRA tensor under its PEFT
name; with `--packing isolated` also `position_ids` (int64 [batch, seq], each document's
tokens numbered from 0: docs/DATA.md). Outputs: train `loss` and `<lora name>.grad` for each
LoRA tensor; eval `loss`; forward `logits` [batch, seq, vocab].
"""
from __future__ import annotations

from pathlib import Path

GRAPHS = ("train", "eval", "forward")


def export_onnx(out_path, config: dict, train, graph: str = "train") -> Path:
    import onnx

    from lorac.graphs import ModelSpec, build_eval_graph, build_forward_graph, build_training_graph
    build = {"train": build_training_graph, "eval": build_eval_graph, "forward": build_forward_graph}[graph]
    model = build(ModelSpec.from_hf_config(config), train)
    from .output import staged
    out = Path(out_path)
    with staged(out, "file", fmt="onnx") as tmp:  # whole or not at all, never over a foreign file
        onnx.save(model, str(tmp))
    return out
