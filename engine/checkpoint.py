"""Loading Hugging Face causal-LM checkpoints of the Llama family from a local directory."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from engine.cpu_linear import pack_linears
from engine.token_map import TokenMap, TokenMapError, load_token_map

# Decoders whose layers are (input norm, q/k/v/o attention with RoPE, post norm, MLP): the runtime
# drives their modules directly.
ARCHITECTURES_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES_BY_MODEL_TYPE.values())

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_DTYPE = "auto"  # the dtype the checkpoint was saved in, where the device computes in it natively


def resolve_dtype(requested: str, saved: object, device: torch.device | str) -> str:
    """The dtype name to load weights in: ``requested`` itself, or for "auto" the checkpoint's saved dtype
    (``config.dtype``) when it is bfloat16/float16 and ``device`` computes in it natively (CUDA; bfloat16 on a
    CPU with native bf16 matrix units), float32 otherwise. Raises CheckpointError for an unknown name."""
    if requested != AUTO_DTYPE:
        if requested not in DTYPES:
            raise CheckpointError(f"unknown dtype {requested!r}; choose {AUTO_DTYPE} or one of {sorted(DTYPES)}")
        return requested
    name = str(saved).removeprefix("torch.") if saved is not None else "float32"
    if name not in ("bfloat16", "float16"):
        return "float32"
    if torch.device(device).type == "cuda":
        return name
    return name if name == "bfloat16" and _cpu_has_native_bf16() else "float32"


def _cpu_has_native_bf16() -> bool:
    """True when oneDNN runs bfloat16 matrix products natively on this CPU (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class CheckpointError(ValueError):
    """A model directory that specserve cannot serve; the message says why and what to do."""


@dataclass
class Checkpoint:
    """A loaded model, its tokenizer (None when the directory has none), its token map (None unless the model
    covers a subset of its tokenizer's vocabulary, see engine.token_map) and where it came from."""

    path: Path
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    token_map: TokenMap | None = None

    @property
    def name(self) -> str:
        """The checkpoint's name: its directory name (or `_name_or_path` when that is set)."""
        return self.path.name

    @property
    def vocab_size(self) -> int:
        """The ids the model reads and whose logits it returns: the embedding's rows (those of its LM head),
        or the vocabulary its token map serves."""
        if self.token_map is not None:
            return self.token_map.target_vocab_size
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def max_context(self) -> int:
        """The longest sequence (prompt + generated) served exactly like HF transformers does."""
        config = self.model.config
        limit = int(config.max_position_embeddings)
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True):
            limit = min(limit, int(window))
        return limit

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids from the generation config, the model config and the tokenizer."""
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return sorted(ids)

    def tokenizer_json(self) -> str:
        """The tokenizer.json text of the checkpoint ('' when there is none)."""
        path = self.path / "tokenizer.json"
        return path.read_text(encoding="utf-8") if path.is_file() else ""

    def vocab_fingerprint(self) -> str:
        """A hash of the token -> id mapping (or of the vocabulary size when there is no tokenizer)."""
        digest = hashlib.sha256()
        if self.tokenizer is None:
            digest.update(f"vocab_size={self.vocab_size}".encode())
        else:
            vocab = sorted(self.tokenizer.get_vocab().items(), key=lambda item: item[1])
            digest.update(json.dumps(vocab, ensure_ascii=False).encode())
        return digest.hexdigest()[:16]


def load_checkpoint(path: str | Path, dtype: str = "float32", device: torch.device | str = "cpu",
                    packed_linears: bool = True) -> Checkpoint:
    """Load a local HF checkpoint (safetensors only, no remote code) in eval mode, its weights in ``dtype``
    (a name of ``DTYPES``, or "auto": see ``resolve_dtype``) on ``device``, for inference. With
    ``packed_linears`` its float32 linear layers on a CPU run on packed weights (``engine.cpu_linear``; they
    then have no ``weight`` tensor, and the state dict is unchanged); without, the model is transformers' own.

    Raises CheckpointError with an actionable message for a missing directory, an unsupported
    architecture, an unknown dtype or a token map that does not fit the model.
    """
    directory = Path(path).expanduser().resolve()
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} is not a model directory: config.json is missing")
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    dtype = resolve_dtype(dtype, getattr(config, "dtype", None), device)
    architectures = set(config.architectures or [])
    if not architectures & SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{directory}: architecture {sorted(architectures) or 'unknown'} is not supported; "
            f"specserve serves {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=DTYPES[dtype], use_safetensors=True, local_files_only=True
    )
    model.to(device).eval()
    if packed_linears:
        pack_linears(model)
    try:
        token_map = load_token_map(directory, int(model.get_input_embeddings().weight.shape[0]))
    except TokenMapError as exc:
        raise CheckpointError(str(exc)) from exc
    tokenizer = None
    if (directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return Checkpoint(path=directory, model=model, tokenizer=tokenizer,
                      token_map=token_map.to(device) if token_map is not None else None)
