"""Load the recipe's model the way it trains: Hugging Face checkpoint, attention backend, LoRA."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UserError
from ..hub import hub_failure, is_hub_id, no_hub_kernels_offline
from ..recipe import Recipe
from .rope import apply_rope, check_rope_record, load_model_config, recipe_rope, resolve_rope, rope_parameters_of


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
    """One line naming model.path when its folder is no loadable checkpoint (no config, no weights), when the
    recipe's rope setting cannot apply to it, and when data.max_seq_len exceeds the positions it reads."""
    path = Path(recipe.model.path)
    _require_checkpoint(path, "model.path")
    if not any(any(path.glob(pattern)) for pattern in _WEIGHT_FILES):
        raise ModelLoadError(f"model.path: no weights in {path} (expected model.safetensors or pytorch_model.bin)")
    config = load_model_config(str(path))
    setting = resolve_rope(recipe, config)
    if setting is not None and setting.parameters.get("rope_type") == "dynamic":
        return  # dynamic scaling stretches to any length, measured against the native positions
    positions = setting.max_position_embeddings if setting else getattr(config, "max_position_embeddings", None)
    if positions and recipe.data.max_seq_len > positions:
        rope = rope_parameters_of(config) or {}
        where = f"data.max_seq_len ({recipe.data.max_seq_len}) is above model.path's max_position_embeddings ({positions})"
        if rope.get("rope_type", "default") == "default":
            raise ModelLoadError(f"{where}; lower it, or extend the model with model.rope_scaling (e.g. type: yarn)")
        import warnings

        warnings.warn(f"{where}; relying on its rope scaling ({rope['rope_type']})", stacklevel=2)


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
    """The base model with the recipe's dtype, attention and rope setting (written into its config before it is
    built, so transformers' own rotary initialisation computes it), registering `sparsebalance` first if asked."""
    from transformers import AutoModelForCausalLM

    path = recipe.model.path
    if not is_hub_id(path):
        _require_checkpoint(Path(path), "model.path")
    if recipe.model.attn_implementation == "sparsebalance":
        from ..attention import register_sparse_attention

        register_sparse_attention()
    no_hub_kernels_offline()
    try:
        config = load_model_config(path)
        apply_rope(config, resolve_rope(recipe, config))
        return AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=resolve_dtype(recipe.model.dtype), attn_implementation=recipe.model.attn_implementation
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
        check_rope_record(adapter_dir, recipe_rope(recipe), "adapter")
        return PeftModel.from_pretrained(model, adapter_dir, is_trainable=trainable)
    lora = recipe.lora
    full = list(lora.modules_to_save) + (embedding_and_norm_modules(model) if lora.train_embeddings_and_norms else [])
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        modules_to_save=full or None,
        # a head tied to the embeddings (SmolLM2) follows the trained embedding copy, in training and in the merge
        ensure_weight_tying=_trains_tied_embeddings(model, full),
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as error:
        raise ModelLoadError(f"lora.target_modules: {str(error).splitlines()[0]}") from None


def _is_norm(module: torch.nn.Module) -> bool:
    """A normalisation layer of any family (LayerNorm, LlamaRMSNorm, Qwen2RMSNorm, ...): a leaf named *Norm."""
    return "Norm" in type(module).__name__ and not any(True for _ in module.children())


def embedding_and_norm_modules(model: torch.nn.Module) -> list[str]:
    """Full names of the input embedding and every norm of the loaded model, as LongLoRA trains them in full.

    Full dotted names, because peft matches modules_to_save by suffix: `norm` alone would also match
    `input_layernorm`, and a leaf name could name an unrelated module in another family."""
    embedding = model.get_input_embeddings()
    return [name for name, module in model.named_modules() if name and (module is embedding or _is_norm(module))]


def _trains_tied_embeddings(model: torch.nn.Module, full: list[str]) -> bool:
    """The head shares the input embedding's weight and modules_to_save names the embedding (peft's suffix match)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    names = [name for name, module in model.named_modules() if module is embedding]
    return tied and any(name.endswith(entry) for name in names for entry in full)


def full_training_summary(model: torch.nn.Module) -> str | None:
    """Parameters trained in full beside LoRA (peft's modules_to_save copies) and the memory they add:
    weights, gradients and two AdamW moments; None when there are none."""
    params = {id(p): p for name, p in model.named_parameters() if p.requires_grad and ".modules_to_save." in name}
    if not params:
        return None
    count = sum(p.numel() for p in params.values())
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    mib = 4 * weight_bytes / 2**20
    return f"trained in full beside LoRA: {count:,} parameters ({mib:.0f} MiB with gradients and AdamW state)"


def enable_checkpointing(model) -> None:
    """Recompute each decoder layer in the backward (non-reentrant), with the input embeddings' output
    requiring grad so that checkpointed LoRA layers get gradients. transformers 5.x renamed
    `gradient_checkpointing_enable` to `activation_checkpointing_enable`, which also sets the embeddings'
    hook, and warns on every call of the old name; the releases before the rename only know the old one."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()


def load_model(recipe: Recipe, adapter_dir: str | Path | None = None, trainable: bool = True):
    """`(model, tokenizer)` as training and evaluation use them; LoRA applied when the recipe enables it."""
    tokenizer = load_tokenizer(recipe)
    model = load_base_model(recipe)
    if recipe.lora.enabled or adapter_dir is not None:
        model = apply_lora(model, recipe, adapter_dir, trainable)
    if recipe.uses_gradient_checkpointing:
        enable_checkpointing(model)
    if not trainable:
        model.eval()
    return model, tokenizer
