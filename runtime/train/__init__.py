"""The training run: plan, load, loop, checkpoint, report (docs/RUNTIME.md).

    from lorac.runtime.train import TrainConfig, train
    summary = train(TrainConfig(model="Qwen/Qwen3-0.6B", data="chats.jsonl", steps=200))
"""
