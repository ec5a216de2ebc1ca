"""Shared by the torch+PEFT GPU peers (peer_mamba.py, peer_lora_gpu.py): the LoRA+
AdamW they train with and how a training step is timed."""
import time

import torch


def loraplus_adamw(model, lr: float, ratio: float = 16.0, **kw) -> torch.optim.AdamW:
    """AdamW over the trainable LoRA tensors, B matrices at `ratio` x the A learning rate."""
    a = [p for n, p in model.named_parameters() if p.requires_grad and "lora_A" in n]
    b = [p for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n]
    return torch.optim.AdamW([{"params": a, "lr": lr}, {"params": b, "lr": ratio * lr}], **kw)


def train_step_seconds(fwd, ids, opt, steps: int, warm: int) -> float:
    """Seconds per step (forward with labels = ids, backward, optimizer), after `warm` steps."""
    def step():
        fwd(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    for _ in range(warm):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t) / steps
