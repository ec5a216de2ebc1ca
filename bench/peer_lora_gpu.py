"""Peer for lorac's GPU benchmarks: torch + PEFT LoRA training, bf16, LoRA r=16 alpha 32 on all
seven linear targets, LoRA+ AdamW (ratio 16, fused), random-init models of the benchmark shapes
(no hub access); a step = forward with labels, backward, optimizer step, as lorac's full step.

    peer_lora_gpu.py MODEL BxS MODE [MODE ...]      e.g. qwen3-0.6b 8x1024 compile eager
MODE: eager | eager-gc (gradient checkpointing) | compile | reduce-overhead (torch.compile with
CUDA graphs). Prints one JSON line per mode: step_ms, tok_s, peak_gb (max allocated), reserved_gb,
warm_s (the first steps, compile included)."""
import json
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from peer_gpu_common import loraplus_adamw, train_step_seconds

MODELS = {
    "smollm2-135m": (LlamaConfig, dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                       num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                       rope_theta=100000.0)),
    "qwen3-40m": (Qwen3Config, dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)),
    "qwen3-0.6b": (Qwen3Config, dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                     num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                     tie_word_embeddings=True, rope_theta=1e6)),
    "llama3-8b": (LlamaConfig, dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                    tie_word_embeddings=False, rope_theta=500000.0)),
}


def lora_model(name: str, S: int, gradient_checkpointing: bool = False):
    """The random-init bf16 model `name` on the GPU (seed 0) with PEFT LoRA r=16 on all seven targets."""
    conf_cls, cfg = MODELS[name]
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(conf_cls(**cfg, max_position_embeddings=max(S, 4096)),
                                                 torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))


def run(name, B, S, mode, steps=8, warm=3):
    cfg = MODELS[name][1]
    model = lora_model(name, S, gradient_checkpointing=mode == "eager-gc")
    opt = loraplus_adamw(model, 1e-4, fused=True)
    fwd = {"compile": lambda m: torch.compile(m), "reduce-overhead": lambda m: torch.compile(m, mode="reduce-overhead")
           }.get(mode, lambda m: m)(model)
    ids = torch.randint(0, cfg["vocab_size"], (B, S), device="cuda")
    t0 = time.perf_counter()
    train_step_seconds(fwd, ids, opt, 1, warm - 1)  # compiles, captures, allocates
    warm_s = time.perf_counter() - t0
    dt = train_step_seconds(fwd, ids, opt, steps, 0)
    return dict(peer="torch+peft", model=name, mode=mode, B=B, S=S, step_ms=round(dt * 1e3, 2),
                tok_s=round(B * S / dt), peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2),
                reserved_gb=round(torch.cuda.max_memory_reserved() / 1e9, 2), warm_s=round(warm_s, 1))


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), file=sys.stderr, flush=True)
    name, shape, modes = sys.argv[1], sys.argv[2], sys.argv[3:]
    B, S = map(int, shape.split("x"))
    for mode in modes:
        try:
            print(json.dumps(run(name, B, S, mode)), flush=True)
        except Exception as e:  # report and continue with the next mode
            print(json.dumps(dict(peer="torch+peft", model=name, mode=mode, B=B, S=S, error=repr(e)[:300])), flush=True)
        torch.cuda.empty_cache()
