"""Converting a GGUF file into a Hugging Face safetensors checkpoint that specserve loads.

transformers reads GGUF (de-quantizing every tensor to float32) but refuses to ``save_pretrained`` such a
model; this module writes the de-quantized weights itself: ``model.safetensors`` (tied output embedding
left out, as HF does), a ``config.json`` without the GGUF quantization entry and with ``architectures``
set, the generation config and the tokenizer. The directory appears atomically: a half-written
conversion is never mistaken for a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.checkpoint import ARCHITECTURES_BY_MODEL_TYPE

SOURCE_FILE = "specserve-source.json"  # written last into a converted checkpoint: where it came from


def _architecture(model_type: str) -> str:
    if model_type not in ARCHITECTURES_BY_MODEL_TYPE:
        raise ValueError(f"GGUF model type {model_type!r} is not served by specserve; "
                         f"supported: {sorted(ARCHITECTURES_BY_MODEL_TYPE)}")
    return ARCHITECTURES_BY_MODEL_TYPE[model_type]


def _write_checkpoint(gguf_file: Path, directory: Path, label: str, progress: bool) -> None:
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [_architecture(config.model_type)]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for key in tqdm(list(state), desc=f"writing {label}", unit="tensor", disable=not progress):
        if tied and key == "lm_head.weight":
            continue
        tensors[key] = state[key].detach().contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    stat = gguf_file.stat()
    source = {"gguf_file": str(gguf_file), "gguf_bytes": stat.st_size, "tensors": len(tensors)}
    (directory / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")


def is_converted(directory: Path) -> bool:
    """True iff ``directory`` holds a finished conversion (its source record is written last)."""
    return (directory / SOURCE_FILE).is_file() and (directory / "model.safetensors").is_file()


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Convert ``gguf_file`` into the HF checkpoint directory ``out_dir`` and return ``out_dir``.

    Idempotent and safe under concurrency: an existing finished conversion is returned as it is; the new
    one is written to a temporary sibling and renamed into place, so readers only ever see a complete
    checkpoint. Raises FileNotFoundError for a missing GGUF file, ValueError for an unsupported model type.
    """
    gguf_file, out_dir = Path(gguf_file).resolve(), Path(out_dir).resolve()
    if is_converted(out_dir):
        return out_dir
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _write_checkpoint(gguf_file, scratch, out_dir.name, progress)
        scratch.chmod(0o755)
        try:
            os.replace(scratch, out_dir)
        except OSError:
            if not is_converted(out_dir):  # a stale partial directory: replace it
                shutil.rmtree(out_dir, ignore_errors=True)
                os.replace(scratch, out_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out_dir
