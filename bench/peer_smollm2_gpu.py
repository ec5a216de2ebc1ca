"""Peer for lorac's SmolLM2 runs on a GPU: torch + PEFT, bf16, LoRA r=16 alpha 32 on all seven
linear targets, LoRA+ AdamW (ratio 16), random-init SmolLM2-135M shape (no hub access).
Usage: peer_smollm2_gpu.py BxS [BxS ...]; prints one JSON line per (shape, eager|compile)."""
import json
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0)


def run(B, S, compiled, steps=10, warm=3):
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to("cuda", torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    a = [p for n, p in model.named_parameters() if p.requires_grad and "lora_A" in n]
    b = [p for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n]
    opt = torch.optim.AdamW([{"params": a, "lr": 2e-4}, {"params": b, "lr": 16 * 2e-4}], fused=True)
    fwd = torch.compile(model) if compiled else model
    ids = torch.randint(0, SMOLLM2["vocab_size"], (B, S), device="cuda")

    def step():
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / steps
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
