"""Data-parallel lorac on 2 GPUs against 1 GPU, with torch DDP + PEFT (torchrun) as the peer.
NOT RUN YET: written for the nvidia-h200-x2 machine (docs/DISTRIBUTED.md, "GPU status").

    .venv/bin/python bench/dp_gpu.py prepare ROOT    # here, no GPU: model files, data, CUDA artifacts
    python3 bench/dp_gpu.py device ROOT OUT          # on the 2-GPU machine (bench/dp_gpu_session.sh)

The case is issue 14's: Qwen3-0.6B shape (random weights, seed 0), bf16, LoRA r=16 on all seven
targets, 8x1024 rows per GPU. `device` runs, each for STEPS steps:
  1. lorac, 1 GPU, --batch 8                    tokens/s of one GPU
  2. lorac, 1 GPU, --batch 8 --grad-accum 2     the same 16 rows a step as 3, on one GPU
  3. lorac, --gpus 2, --batch 16                tokens/s of two GPUs, losses against 2
  4. torchrun --nproc-per-node 1 and 2 bench/peer_ddp_gpu.py qwen3-0.6b 8x1024 eager compile
and prints one JSON line per run and a summary: the 2-GPU/1-GPU tokens/s ratio (issue: >= 1.9)
and the largest relative difference between the per-step losses of 2 and 3. Every row of the
plain-text data counts all its tokens, so both workers' shares are exactly 1/2 and run 3 computes
0.5*g1 + 0.5*g2 where run 2 computes (g1 + g2)/2 from the same two bf16 micro-batch steps: the
losses should agree to float rounding (cuDNN's attention backward may add its own nondeterminism).
Both lorac runs use one artifact (the batch-8 step), compiled here by `prepare`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
QWEN3_06B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                 intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                 max_position_embeddings=40960, hidden_act="silu", torch_dtype="bfloat16", eos_token_id=1)
B, S, STEPS = 8, 1024, 12
COMMON = ["--seq", str(S), "--steps", str(STEPS), "--rank", "16", "--alpha", "32", "--lr", "1e-4", "--warmup", "2",
          "--eval-batches", "0", "--sample-tokens", "0", "--save-every", "1000", "--target", "cuda"]


def write_model(root: Path) -> Path:
    """config.json, tokenizer files and random fp16 safetensors (seed 0, std 0.02; norms 1)."""
    from safetensors.numpy import save_file
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_06B))
    _tokenizer(model)
    if (model / "model.safetensors").is_file():
        return model
    c = QWEN3_06B
    H, I, D = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    qd, kd = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    rng = np.random.default_rng(0)
    w = lambda *shape: (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)  # noqa: E731
    t = {"model.embed_tokens.weight": w(c["vocab_size"], H), "model.norm.weight": np.ones(H, np.float16)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": np.ones(H, np.float16),
                  p + "post_attention_layernorm.weight": np.ones(H, np.float16),
                  p + "self_attn.q_norm.weight": np.ones(D, np.float16), p + "self_attn.k_norm.weight": np.ones(D, np.float16),
                  p + "self_attn.q_proj.weight": w(qd, H), p + "self_attn.k_proj.weight": w(kd, H),
                  p + "self_attn.v_proj.weight": w(kd, H), p + "self_attn.o_proj.weight": w(H, qd),
                  p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H), p + "mlp.down_proj.weight": w(H, I)})
    save_file(t, str(model / "model.safetensors"), metadata={"format": "pt"})
    return model


def _tokenizer(model: Path) -> None:
    """A character-level tokenizer (ids below 100 of Qwen3's 151936): enough to time and compare."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    chars = string.ascii_letters + string.digits + string.punctuation + " \n"
    vocab = {ch: i for i, ch in enumerate(["<unk>", "<|endoftext|>"] + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Split("", "isolated"), decoders.Fuse()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def write_data(root: Path) -> Path:
    """Plain text (every token counts) for 16 rows x STEPS steps and more, seed 0."""
    rng = np.random.default_rng(0)
    words = ["lorac", "graph", "tensor", "kernel", "adapter", "gradient", "rank", "batch", "token", "step"]
    docs = [" ".join(rng.choice(words, 200)) + "." for _ in range(2 * 16 * (STEPS + 4) * S // 1400 + 40)]
    path = root / "data.txt"
    path.write_text("\n\n".join(docs))
    return path


def lorac(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lorac.runtime.cli", "train", *map(str, args)],
                          capture_output=True, text=True, env=env)


def prepare(root: Path) -> None:
    """Compile the per-GPU step (batch 8) for CUDA, and fetch the cp312 MPI wheels the GPU machine
    lacks; the random weights are left out of ROOT (the device makes the same bytes from seed 0)."""
    model, data = write_model(root), write_data(root)
    r = lorac("--model", model, "--data", data, "--cache-dir", root / "cache", "--out", root / "compile-out",
              "--compile-only", "--gpus", "2", "--batch", 2 * B, *COMMON)
    print(r.stderr[-3000:])
    r.check_returncode()
    (model / "model.safetensors").unlink()
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", str(root / "whl"),
                    "mpi4py>=4.0", "mpich>=4.2"], check=True)


def _steps(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]


def device(root: Path, out: Path) -> None:
    model, data = write_model(root), root / "data.txt"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    runs = {"1gpu": ["--batch", B], "1gpu-accum2": ["--batch", B, "--grad-accum", 2], "2gpu": ["--batch", 2 * B, "--gpus", 2]}
    res = {}
    for name, extra in runs.items():
        r = lorac("--model", model, "--data", data, "--cache-dir", root / "cache", "--out", out / name, *COMMON, *extra,
                  env=env)
        (out / f"{name}.log").write_text(r.stderr)
        if r.returncode:
            print(json.dumps({"run": name, "error": r.stderr.strip().splitlines()[-1:]}), flush=True)
            continue
        steps = _steps(out / name)
        tok_s = float(np.median([s["tokens_per_s"] for s in steps[2:]]))
        res[name] = dict(run=name, tok_s=round(tok_s), step_ms=round(float(np.median([s["step_s"] for s in steps[2:]])) * 1e3, 1),
                         losses=[s["loss"] for s in steps])
        print(json.dumps(res[name]), flush=True)
    if "1gpu" in res and "2gpu" in res:
        summary = {"tok_s_ratio_2gpu_over_1gpu": round(res["2gpu"]["tok_s"] / res["1gpu"]["tok_s"], 3)}
        if "1gpu-accum2" in res:
            a, b = np.array(res["2gpu"]["losses"]), np.array(res["1gpu-accum2"]["losses"])
            summary["max_rel_loss_diff_vs_1gpu_accum2"] = float(np.max(np.abs(a - b) / np.abs(b)))
        print(json.dumps(summary), flush=True)
    for n in (1, 2):
        r = subprocess.run(["torchrun", "--standalone", f"--nproc-per-node={n}", str(HERE / "peer_ddp_gpu.py"),
                            "qwen3-0.6b", f"{B}x{S}", "eager", "compile"], capture_output=True, text=True, env=env,
                           cwd=HERE, timeout=900)
        print(r.stdout.strip() or json.dumps({"peer": f"torchrun x{n}", "error": r.stderr.strip()[-500:]}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"]:
        prepare(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["device"]:
        device(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(__doc__)
