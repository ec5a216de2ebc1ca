"""Peer for lorac's Mamba-1 runs: HF MambaForCausalLM + PEFT LoRA r=16 on in_proj, x_proj,
dt_proj (PEFT refuses out_proj), LoRA+ AdamW, random-init Mamba-130M shape (or another
width/depth); bf16 on the GPU, fp32 on the CPU. A step = forward with labels, backward,
optimizer step, as lorac's full step.

    peer_mamba.py BxS [STEPS [MODE]] [--hidden D --layers N] [--device cpu --threads T]
MODE: torch (default): transformers' plain PyTorch path, also where mamba_ssm is installed
(this process hides it); mamba_ssm: transformers' CUDA-kernel path (mamba_ssm's fused
mamba_inner_fn: selective scan and causal_conv1d kernels), an error line if mamba_ssm or
causal_conv1d is not importable. On that path transformers hands mamba_inner_fn the x_proj,
dt_proj and out_proj *weights*, so only in_proj's LoRA trains there.
Prints one JSON line: step_ms, tok_s, peak_gb (max allocated; on the CPU the peak resident
set), reserved_gb (GPU) and step_s."""
import argparse
import importlib.util
import json
import sys

ap = argparse.ArgumentParser()
ap.add_argument("shape")
ap.add_argument("steps", nargs="?", type=int, default=2)
ap.add_argument("mode", nargs="?", default="torch", choices=["torch", "mamba_ssm"])
ap.add_argument("--hidden", type=int, default=768)
ap.add_argument("--layers", type=int, default=24)
ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
ap.add_argument("--threads", type=int, default=0, help="cpu: torch threads (0: torch's default)")
a = ap.parse_args()
B, S = map(int, a.shape.split("x"))
row = dict(peer="hf-mamba+peft", mode=a.mode, B=B, S=S)
if a.mode == "torch":
    sys.modules["mamba_ssm"] = None  # transformers picks its kernels at import: hide them
elif not all(importlib.util.find_spec(p) for p in ("mamba_ssm", "causal_conv1d")):
    print(json.dumps({**row, "error": "mamba_ssm / causal_conv1d are not installed here"}), flush=True)
    sys.exit(0)

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import MambaConfig, MambaForCausalLM  # noqa: E402

from peer_gpu_common import loraplus_adamw, train_step_seconds  # noqa: E402

gpu = a.device == "cuda"
if a.threads:
    torch.set_num_threads(a.threads)
try:
    torch.manual_seed(0)
    cfg = MambaConfig(vocab_size=50280, hidden_size=a.hidden, state_size=16, expand=2, conv_kernel=4,
                      num_hidden_layers=a.layers, tie_word_embeddings=True)
    m = get_peft_model(MambaForCausalLM(cfg).to(a.device, torch.bfloat16 if gpu else torch.float32),
                       LoraConfig(r=16, lora_alpha=32, target_modules=["in_proj", "x_proj", "dt_proj"]))
    opt = loraplus_adamw(m, 1e-4)
    ids = torch.randint(0, 50280, (B, S), device=a.device)
    dt = train_step_seconds(m, ids, opt, a.steps, warm=1)
    row.update(step_ms=round(dt * 1e3, 1), step_s=round(dt, 3), tok_s=round(B * S / dt))
    if gpu:
        row.update(peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 1),
                   reserved_gb=round(torch.cuda.max_memory_reserved() / 1e9, 1))
    else:
        import resource
        row.update(peak_gb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 1), device="cpu")
except Exception as e:  # out of memory, a kernel that does not build: one line, not a traceback
    row["error"] = repr(e)[:300]
print(json.dumps(row), flush=True)
