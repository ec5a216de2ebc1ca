"""The training run: plan (plan.py), load (run.py), loop (loop.py), checkpoint, resume,
report (docs/RUNTIME.md).

    from lorac.runtime.config import TrainConfig
    from lorac.runtime.train.loop import train
    summary = train(TrainConfig(model="Qwen/Qwen3-0.6B", data="chats.jsonl", steps=200))
"""
