"""Load the recipe's model the way it trains: Hugging Face checkpoint, attention backend, LoRA."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UserError
from ..hub import hub_failure, is_hub_id
from ..recipe import Recipe


class ModelLoadError(UserError):
    """The model or tokenizer directory cannot be loaded as a Hugging Face checkpoint."""


def resolve_dtype(name: str) -> torch.dtype:
    """`auto` means bfloat16 where the accelerator computes it natively, float32 elsewhere (CPU)."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return getattr(torch, name)


def resolve_mixed_precision(name: str) -> str:
    """`auto` is bf16 where a GPU computes it natively, none on CPU; fp16 autocast needs a GPU (CPU ignores it)."""
    if name == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    if name == "fp16" and not torch.cuda.is_available():
        raise ModelLoadError("training.mixed_precision: fp16 needs a CUDA GPU; on CPU use bf16 or no")
    return name


_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")


def check_model_dir(recipe: Recipe) -> None:
    """One line naming model.path when its folder is no loadable checkpoint (no config, no weights),
    and when data.max_seq_len exceeds the positions the model was trained for without rope scaling."""
    path = Path(recipe.model.path)
    _require_checkpoint(path, "model.path")
    if not any(any(path.glob(pattern)) for pattern in _WEIGHT_FILES):
        raise ModelLoadError(f"model.path: no weights in {path} (expected model.safetensors or pytorch_model.bin)")
    config = json.loads((path / "config.json").read_text())
    positions = config.get("max_position_embeddings")
    if positions and recipe.data.max_seq_len > positions:
        rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
        scaled = rope.get("rope_type", rope.get("type", "default")) not in (None, "default")
        where = f"data.max_seq_len ({recipe.data.max_seq_len}) is above model.path's max_position_embeddings ({positions})"
        if not scaled:
            raise ModelLoadError(f"{where}; lower it, or configure rope scaling in {path / 'config.json'}")
        import warnings

        warnings.warn(f"{where}; relying on its rope scaling ({rope.get('rope_type', rope.get('type'))})", stacklevel=2)


def _require_checkpoint(path: Path, key: str) -> None:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{key}: not a Hugging Face checkpoint (no config.json): {path}")
    try:
        json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path / 'config.json'}:{error.lineno}: not valid JSON") from None


def load_tokenizer(recipe: Recipe):
    from transformers import AutoTokenizer

    key, path = ("data.tokenizer", recipe.data.tokenizer) if recipe.data.tokenizer else ("model.path", recipe.model.path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        if is_hub_id(path):
            raise ModelLoadError(hub_failure(key, path, error)) from None
        raise ModelLoadError(f"{key}: cannot load a tokenizer from {path}: {str(error).splitlines()[0]}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(recipe: Recipe):
    """The base model with the recipe's dtype and attention, registering `sparsebalance` first if asked."""
    from transformers import AutoModelForCausalLM

    path = recipe.model.path
    if not is_hub_id(path):
        _require_checkpoint(Path(path), "model.path")
    if recipe.model.attn_implementation == "sparsebalance":
        from ..attention import register_sparse_attention

        register_sparse_attention()
    try:
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(recipe.model.dtype), attn_implementation=recipe.model.attn_implementation
        )
    except OSError as error:
        if is_hub_id(path):
            raise ModelLoadError(hub_failure("model.path", path, error)) from None
        raise


def apply_lora(model, recipe: Recipe, adapter_dir: str | Path | None = None, trainable: bool = True):
    """Wrap in a peft LoRA adapter: a fresh one from the recipe, or the saved one in `adapter_dir`."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_dir is not None:
        adapter_dir = Path(adapter_dir)
        if not (adapter_dir / "adapter_config.json").is_file():
            raise ModelLoadError(f"{adapter_dir}: no LoRA adapter here (adapter_config.json missing)")
        return PeftModel.from_pretrained(model, adapter_dir, is_trainable=trainable)
    lora = recipe.lora
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        modules_to_save=lora.modules_to_save or None,
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as error:
        raise ModelLoadError(f"lora.target_modules: {str(error).splitlines()[0]}") from None


def load_model(recipe: Recipe, adapter_dir: str | Path | None = None, trainable: bool = True):
    """`(model, tokenizer)` as training and evaluation use them; LoRA applied when the recipe enables it."""
    tokenizer = load_tokenizer(recipe)
    model = load_base_model(recipe)
    if recipe.lora.enabled or adapter_dir is not None:
        model = apply_lora(model, recipe, adapter_dir, trainable)
    if recipe.uses_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    if not trainable:
        model.eval()
    return model, tokenizer
