"""The base model: where it comes from (source.py, hub.py), its weights (weights.py: HF
safetensors, gguf.py: GGUF), its tokenizer and chat template, and adapters to start from."""
