"""Peer for lorac's SmolLM2 runs on a GPU: torch + PEFT, bf16, LoRA r=16 alpha 32 on all seven
linear targets, LoRA+ AdamW (ratio 16), random-init SmolLM2-135M shape (no hub access).
Usage: peer_smollm2_gpu.py BxS [BxS ...]; prints one JSON line per (shape, eager|compile)."""
import json
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from peer_gpu_common import loraplus_adamw, train_step_seconds

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0)


def run(B, S, compiled, steps=10, warm=3):
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to("cuda", torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    opt = loraplus_adamw(model, 2e-4, fused=True)
    fwd = torch.compile(model) if compiled else model
    ids = torch.randint(0, SMOLLM2["vocab_size"], (B, S), device="cuda")
    dt = train_step_seconds(fwd, ids, opt, steps, warm)
    print(json.dumps(dict(peer="torch+peft", mode="compile" if compiled else "eager", B=B, S=S,
                          step_ms=round(dt * 1e3, 2), tok_s=round(B * S / dt), peak_gb=round(
                              torch.cuda.max_memory_allocated() / 1e9, 2))), flush=True)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    for shape in sys.argv[1:]:
        B, S = map(int, shape.split("x"))
        for compiled in (False, True):
            try:
                run(B, S, compiled)
            except Exception as e:  # report and continue with the next case
                print(json.dumps(dict(B=B, S=S, compile=compiled, error=repr(e)[:300])), flush=True)
