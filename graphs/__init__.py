"""lorac.graphs: model specs and the ONNX emitters of training and forward graphs.

    from lorac.graphs import ModelSpec, TrainSpec, build_training_graph, build_forward_graph
"""
from .compose import build_eval_graph, build_forward_graph, build_training_graph, lora_tensor_names
from .spec import ALL_TARGETS, ModelSpec, TrainSpec, lora_name, weight_name

__all__ = ["ModelSpec", "TrainSpec", "build_training_graph", "build_forward_graph", "build_eval_graph", "lora_tensor_names",
           "lora_name", "weight_name", "ALL_TARGETS"]
