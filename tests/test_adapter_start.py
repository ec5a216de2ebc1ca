"""--adapter PATH: a PEFT adapter made by PEFT itself (rank 4, q_proj/v_proj, layer 1 only,
random B) is the starting point: lorac's eval loss before step 1 equals the PEFT model's
loss on the same batch, the adapter's settings replace the run's, and adapters that do not
fit the model, or that lorac cannot continue, are refused with one line."""
import json

import numpy as np
import pytest

from lorac.runtime.errors import LoracError
from lorac.runtime.config import TrainConfig
from lorac.runtime.train.loop import train
from tiny_model import make_model_dir

pytest.importorskip("tvm")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TEXT = "the red cat sat on the blue mat. the sly cat sat on the new mat."


def peft_adapter(model_dir, out, seed=1, **config):
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1], init_lora_weights=False)
    model = peft.get_peft_model(base, peft.LoraConfig(**{**cfg, **config}))
    model.save_pretrained(out)
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapter")
    make_model_dir(d / "model")
    (d / "data.txt").write_text((TEXT + "\n\n") * 20)
    (d / "eval.txt").write_text(TEXT + "\n")
    return d, peft_adapter(d / "model", d / "peft")


def test_training_starts_from_the_adapter(setup):
    d, reference = setup
    cfg = TrainConfig(model=str(d / "model"), data=str(d / "data.txt"), eval_data=str(d / "eval.txt"),
                      adapter=str(d / "peft"), out=str(d / "out"), steps=1, batch=1, seq=32, eval_batches=1,
                      sample_tokens=0, cache_dir=str(d / "cache"), rank=16, lora_targets=("o_proj",))
    summary = train(cfg, log=lambda m: None)
    from lorac.runtime.data import load_dataset
    from lorac.runtime.model.tokenizer import load_tokenizer
    tok = load_tokenizer(d / "model")
    batch = next(load_dataset(d / "data.txt", tok, 32, 1000, eval_path=d / "eval.txt").eval_batches(1))
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(batch["input_ids"]), labels=torch.from_numpy(batch["labels"])).loss
    assert abs(summary["eval_loss_before"] - float(want)) <= 1e-4 * float(want)
    state = json.loads(next((d / "out" / "checkpoints").glob("ckpt-*/state.json")).read_text())
    tc = state["train_config"]
    assert (tc["rank"], tc["alpha"], tc["lora_targets"], tc["trained_layers"]) == (4, 8.0, ["q_proj", "v_proj"], "1")
    exported = json.loads((d / "out" / "adapter" / "adapter_config.json").read_text())
    assert exported["layers_to_transform"] == [1] and exported["r"] == 4 and exported["lora_alpha"] == 8.0


def test_refusals(setup, tmp_path):
    from lorac.graphs import ModelSpec
    from lorac.runtime.model.adapter_in import read_adapter
    from safetensors.numpy import load_file, save_file
    d, _ = setup
    spec = ModelSpec.from_hf_config(json.loads((d / "model" / "config.json").read_text()))
    with pytest.raises(LoracError, match="not a PEFT adapter directory"):
        read_adapter(d / "model", spec)
    other = make_model_dir(tmp_path / "wide", hidden_size=64, head_dim=16)
    peft_adapter(other, tmp_path / "wide_adapter")
    wide = read_adapter(tmp_path / "wide_adapter", spec)
    shapes = {n: a.shape for n, a in read_adapter(d / "peft", spec).lora.items()}
    with pytest.raises(LoracError, match=r"q_proj.lora_A.weight has shape \[4, 64\], this model needs \[4, 48\]"):
        wide.check_shapes(shapes)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "adapter_config.json").write_text((d / "peft" / "adapter_config.json").read_text())
    tensors = load_file(str(d / "peft" / "adapter_model.safetensors"))
    save_file({k.replace("self_attn.q_proj", "mlp.up_proj").replace("self_attn.v_proj", "mlp.gate_proj"): v
               for k, v in tensors.items()}, str(foreign / "adapter_model.safetensors"))
    assert read_adapter(foreign, spec).targets == ("gate_proj", "up_proj")  # a fitting other target set
    spec1 = ModelSpec.from_hf_config({**json.loads((d / "model" / "config.json").read_text()), "num_hidden_layers": 1})
    with pytest.raises(LoracError, match="has LoRA on layer 1, the model has 1 layers"):
        read_adapter(d / "peft", spec1)
    dora = tmp_path / "dora"
    peft_adapter(d / "model", dora, use_dora=True)
    with pytest.raises(LoracError, match=r"uses DoRA \(use_dora\), which lorac cannot continue training"):
        read_adapter(dora, spec)
