"""Peer for lorac's multi-GPU benchmark: torch DistributedDataParallel + PEFT, launched by torchrun.

    torchrun --nproc-per-node N bench/peer_ddp_gpu.py MODEL BxS MODE [MODE ...]   e.g. qwen3-0.6b 8x1024 eager

BxS is per GPU (as lorac's bench/dp_gpu.py: 8x1024 per GPU). Each rank builds the same random-init
model (seed 0; bench/peer_lora_gpu.py's shapes), LoRA r=16 alpha 32 on all seven linear targets,
LoRA+ AdamW (ratio 16, fused), wraps it in DDP (NCCL, gradients bucketed and all-reduced during
the backward) and times forward + backward + optimizer step. MODE: eager | compile. Rank 0 prints
one JSON line per mode: step_ms, tok_s (all GPUs together), peak_gb (its GPU's max allocated).
NCCL_NVLS_ENABLE stays 0 (NVLink multicast off, as on lorac's side).
"""
import json
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from peer_gpu_common import loraplus_adamw  # noqa: E402
from peer_lora_gpu import MODELS, lora_model  # noqa: E402


def run(name, B, S, mode, world, steps=8, warm=3):
    cfg = MODELS[name][1]
    model = lora_model(name, S)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    opt = loraplus_adamw(model, 1e-4, fused=True)
    fwd = torch.compile(ddp) if mode == "compile" else ddp
    gen = torch.Generator(device="cuda").manual_seed(1 + dist.get_rank())  # each rank its own rows
    ids = torch.randint(0, cfg["vocab_size"], (B, S), device="cuda", generator=gen)

    def step():
        fwd(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / steps
    return dict(peer="torch-ddp+peft", model=name, mode=mode, gpus=world, B_per_gpu=B, S=S, step_ms=round(dt * 1e3, 2),
                tok_s=round(world * B * S / dt), peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2),
                warm_s=round(warm_s, 1))


if __name__ == "__main__":
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    name, shape, modes = sys.argv[1], sys.argv[2], sys.argv[3:]
    B, S = map(int, shape.split("x"))
    for mode in modes:
        try:
            rec = run(name, B, S, mode, world)
        except Exception as e:  # report and continue with the next mode
            rec = dict(peer="torch-ddp+peft", model=name, mode=mode, gpus=world, error=repr(e)[:300])
        if dist.get_rank() == 0:
            print(json.dumps(rec), flush=True)
    dist.destroy_process_group()
