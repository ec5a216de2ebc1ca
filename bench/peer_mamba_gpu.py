"""Peer for lorac's Mamba-1 runs on a GPU: HF MambaForCausalLM (its plain PyTorch path; no
mamba_ssm kernels) + PEFT LoRA r=16 on in_proj, x_proj, dt_proj (PEFT refuses out_proj),
LoRA+ AdamW, bf16, random-init Mamba-130M shape. Usage: peer_mamba_gpu.py BxS [STEPS]."""
import json
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import MambaConfig, MambaForCausalLM

from peer_gpu_common import loraplus_adamw, train_step_seconds

B, S = map(int, sys.argv[1].split("x"))
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
torch.manual_seed(0)
cfg = MambaConfig(vocab_size=50280, hidden_size=768, state_size=16, expand=2, conv_kernel=4, num_hidden_layers=24,
                  tie_word_embeddings=True)
m = get_peft_model(MambaForCausalLM(cfg).to("cuda", torch.bfloat16),
                   LoraConfig(r=16, lora_alpha=32, target_modules=["in_proj", "x_proj", "dt_proj"]))
opt = loraplus_adamw(m, 1e-4)
ids = torch.randint(0, 50280, (B, S), device="cuda")
dt = train_step_seconds(m, ids, opt, steps, warm=1)
print(json.dumps(dict(peer="hf-mamba-torch-path+peft", B=B, S=S, step_s=round(dt, 3), tok_s=round(B * S / dt),
                      peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 1))), flush=True)
