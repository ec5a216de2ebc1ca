"""Time to emit the Qwen3-0.6B-shape training graph and its serialized size (no weights inside).

Usage: python bench/bench_emit.py [--checkpointing] [--loss-chunk N]
Prints one JSON line; issue #2's targets: <= 10 s on the 2-core machine, <= 10 MB.
"""
import argparse
import json
import time

from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph
from lorac.graphs.memory import peak_live_bytes

QWEN3_06B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--checkpointing", action="store_true")
ap.add_argument("--loss-chunk", type=int, default=0)
args = ap.parse_args()
spec = ModelSpec.from_hf_config(QWEN3_06B)
train = TrainSpec(batch=8, seq=1024, lora_targets=ALL_TARGETS, rank=16, alpha=32,
                  checkpointing=args.checkpointing, loss_chunk=args.loss_chunk)
t0 = time.perf_counter()
model = build_training_graph(spec, train)
emit_s = time.perf_counter() - t0
size = len(model.SerializeToString())
print(json.dumps(dict(graph="qwen3-0.6b-shape 8x1024 r16 all-linear", checkpointing=args.checkpointing,
                      loss_chunk=args.loss_chunk, emit_s=round(emit_s, 2), nodes=len(model.graph.node),
                      onnx_mb=round(size / 2**20, 2), peak_live_gb=round(peak_live_bytes(model) / 2**30, 2))))
