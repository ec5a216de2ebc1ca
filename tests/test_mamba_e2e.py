"""End to end on a tiny random HF MambaForCausalLM directory: `lorac train` learns, the PEFT
adapter (in/x_proj: PEFT refuses out_proj on Mamba and transformers ignores a PEFT LoRA on
dt_proj) and the merged model (all four targets) load in PEFT / transformers with lorac's
forward-graph logits; GGUF is refused."""
import json

import numpy as np
import pytest

from tiny_model import compiled_logits, make_corpus, make_mamba_dir

pytest.importorskip("tvm")
from conftest import run_lorac  # noqa: E402 - the `lorac` command (tests/conftest.py)
TOL = 1e-4


def _run(args):
    return run_lorac(args)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("mamba_e2e")
    make_mamba_dir(d / "model")
    make_corpus(d / "corpus.txt", 240)
    r = _run(["train", "--model", str(d / "model"), "--data", str(d / "corpus.txt"), "--out", str(d / "run"),
              "--steps", "30", "--batch", "4", "--seq", "32", "--lr", "2e-3", "--eval-every", "10",
              "--save-every", "30", "--cache-dir", str(d / "cache")])  # default targets: all four
    assert r.returncode == 0, r.stderr[-2000:]
    return d, r.stderr


def test_training_and_eval_loss_drop(trained):
    d, stderr = trained
    recs = [json.loads(line) for line in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert len(losses) == 30 and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert evals[-1] < evals[0] - 0.5
    assert "leaves out the LoRA on dt_proj, out_proj" in stderr  # the PEFT adapter says what it lacks
    assert "mamba scan chunk: 64 (cpu default)" in stderr  # graphs/mamba.py DEVICE_CHUNK


def test_peft_and_merged_exports_match_lorac_logits(trained):
    import torch
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from lorac.runtime.train.checkpoint import load_checkpoint
    d, _ = trained
    ids = np.random.default_rng(0).integers(0, 60, (1, 24)).astype(np.int64)
    full = load_checkpoint(d / "run" / "checkpoints").lora
    assert all(np.abs(v).max() > 0 for k, v in full.items() if "lora_B" in k)

    # PEFT adapter: in/x_proj only; lorac with the same tensors (dt/out_proj's B = 0) gives its logits
    peft_lora = load_file(str(d / "run" / "adapter" / "adapter_model.safetensors"))
    assert {k.split(".mixer.")[1].split(".")[0] for k in peft_lora} == {"in_proj", "x_proj"}
    base = AutoModelForCausalLM.from_pretrained(d / "model").float().eval()
    peft = PeftModel.from_pretrained(base, d / "run" / "adapter").eval()
    with torch.no_grad():
        theirs = peft(input_ids=torch.from_numpy(ids)).logits.numpy()
    ours = compiled_logits(d / "model", d / "cache", peft_lora, ids)
    assert np.abs(ours - theirs).max() <= TOL * max(1.0, np.abs(theirs).max())

    # merged model: every target folded in
    r = _run(["export", "--checkpoint", str(d / "run" / "checkpoints"), "--format", "merged", "--out", str(d / "merged")])
    assert r.returncode == 0, r.stderr[-2000:]
    m = AutoModelForCausalLM.from_pretrained(d / "merged").float().eval()
    with torch.no_grad():
        merged = m(input_ids=torch.from_numpy(ids)).logits.numpy()
    ours = compiled_logits(d / "model", d / "cache", full, ids)
    assert np.abs(ours - merged).max() <= TOL * max(1.0, np.abs(merged).max())
    assert np.abs(ours - theirs).max() > 10 * TOL  # dt/out_proj's LoRA does matter: the merged model carries it


def test_gguf_export_is_refused_in_one_line(trained):
    d, _ = trained
    r = _run(["export", "--checkpoint", str(d / "run" / "checkpoints"), "--format", "gguf", "--out", str(d / "a.gguf")])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "not supported for mamba" in r.stderr.strip().splitlines()[-1]


def test_out_proj_only_adapter_is_refused_by_peft_export(tmp_path):
    """PEFT refuses out_proj on Mamba: with nothing else in the adapter, a clear error."""
    from lorac.runtime.export import PeftRefused, export_peft
    lora = {f"base_model.model.backbone.layers.0.mixer.out_proj.lora_{ab}.weight": np.zeros(s, np.float32)
            for ab, s in (("A", (2, 8)), ("B", (4, 2)))}
    with pytest.raises(PeftRefused, match="--format merged"):
        export_peft(tmp_path / "a", lora, alpha=4.0)


def test_missing_mamba_tensor_is_named_at_load(tmp_path):
    from safetensors.numpy import load_file, save_file

    from lorac.runtime.errors import LoracError
    from lorac.runtime.model.weights import load_model
    d = make_mamba_dir(tmp_path / "m")
    w = load_file(str(d / "model.safetensors"))
    del w["backbone.layers.1.mixer.A_log"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(LoracError, match=r"tensor backbone\.layers\.1\.mixer\.A_log is missing"):
        load_model(d)
