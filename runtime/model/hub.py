"""Hugging Face Hub ids for --model (and the file picking for GGUF repos), through
`huggingface_hub`: the local HF cache first, so a cached model works offline; a download
only where the cache lacks it and the hub is reachable.

    ORG/NAME            an HF model repo (config.json + safetensors), or a GGUF repo
    ORG/NAME:QUANT      the .gguf file of that quantization in a GGUF repo (as llama.cpp's
                        `-hf` takes it, e.g. bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M)

A GGUF repo without :QUANT gives its Q4_K_M file (llama.cpp's default), else its only .gguf.
Every failure is one line naming the id and what to do.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import LoracError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
# what an HF model directory needs for lorac to train and export it (transformers' weight file
# names only: Mistral repos also hold a consolidated.safetensors copy of every weight)
HF_FILES = ["config.json", "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
            "chat_template.jinja", "generation_config.json"]
DEFAULT_QUANT = "Q4_K_M"


def is_repo_id(text: str) -> bool:
    return bool(REPO_ID.match(text)) and not Path(text).exists()


def pick_gguf(files: list[str], quant: str | None, repo: str) -> str | None:
    """The .gguf file to use among a repo's files (None: an HF repo, no GGUF wanted)."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if not quant and "config.json" in files:
        return None
    if not ggufs:
        raise LoracError(f"{repo}: the repo has neither config.json nor .gguf files")
    want = (quant or DEFAULT_QUANT).lower()
    match = [f for f in ggufs if re.search(rf"(^|[^a-z0-9]){re.escape(want)}([^a-z0-9]|$)", Path(f).stem.lower())]
    if len(match) == 1 or (match and quant is None):
        return match[0]
    if not quant and len(ggufs) == 1:
        return ggufs[0]
    shown = ", ".join(Path(f).name for f in ggufs[:6]) + (" ..." if len(ggufs) > 6 else "")
    raise LoracError(f"{repo}: {'no' if not match else 'more than one'} .gguf file for {want.upper()}; "
                     f"pick one as {repo}:QUANT (files: {shown})")


def _cached(repo: str, repo_type: str = "model"):
    """The cached snapshot folder of the repo's main revision, or None."""
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo, repo_type=repo_type, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError and kin: not in the cache
        return None


def _online(spec: str, kind: str, fetch):
    """fetch() against the hub, or one line saying why the id is not to be had."""
    from huggingface_hub import constants
    where = f"{kind} not found: {spec} is neither a local path nor in the Hugging Face cache"
    if constants.HF_HUB_OFFLINE:
        raise LoracError(f"{where} (HF_HUB_OFFLINE is set; download it where the hub is reachable: hf download "
                         f"{'--repo-type dataset ' if kind == 'data' else ''}{spec.partition(':')[0]})")
    try:
        return fetch()
    except LoracError:
        raise
    except Exception as e:  # network, auth, missing repo: huggingface_hub and its HTTP client raise many kinds
        reason = (str(e).splitlines() or [""])[0] or type(e).__name__
        raise LoracError(f"{where}, and the hub did not give it ({type(e).__name__}: {reason})") from None


def _files_in(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)).replace("\\", "/") for p in folder.rglob("*") if p.is_file())


def resolve_hub_model(spec: str) -> Path:
    """Local path (HF snapshot folder or .gguf file) for ORG/NAME[:QUANT]."""
    repo, _, quant = spec.partition(":")
    folder = _cached(repo)
    found = _in_cache(folder, quant or None, repo) if folder is not None else None
    return found or _online(spec, "model", lambda: _download(repo, quant or None))


def _in_cache(folder: Path, quant, repo: str):
    """What the cached snapshot already holds of the model, or None (then ask the hub)."""
    files = _files_in(folder)
    try:
        chosen = pick_gguf(files, quant, repo)
    except LoracError:
        return None
    if chosen is None:
        return folder if {"model.safetensors", "model.safetensors.index.json"} & set(files) else None
    return folder / chosen


def _download(repo: str, quant) -> Path:
    from huggingface_hub import list_repo_files, snapshot_download
    chosen = pick_gguf(list_repo_files(repo), quant, repo)
    folder = Path(snapshot_download(repo, allow_patterns=[chosen] if chosen else HF_FILES))
    return folder / chosen if chosen else folder


def resolve_hub_dataset(repo: str, spec: str) -> Path:
    """The local snapshot folder of a hub dataset repo: the HF cache first, else a download."""
    from huggingface_hub import snapshot_download
    return _cached(repo, "dataset") or _online(spec, "data", lambda: Path(snapshot_download(repo, repo_type="dataset")))
