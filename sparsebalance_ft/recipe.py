"""The recipe: one YAML file, validated by a typed schema before any work starts.

Each section's model lives beside the component it configures (`attention/config.py`,
`balancer/config.py`); this module assembles them, loads YAML, applies `--set` overrides
and turns every validation failure into one line that names the key or path.
"""
from __future__ import annotations

import hashlib
import typing
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .attention.config import SparsityConfig
from .balancer.config import BalanceConfig
from .errors import UserError
from .hub import is_hub_id


class RecipeError(UserError):
    """A recipe problem a user can fix; the CLI prints it as one line and exits 2."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


CHECKPOINTING_FROM_TOKENS = 4096
"""`gradient_checkpointing: auto` turns on from this sequence length. Measured on SmolLM2-135M
(`sbft bench memory`): at 2,048 tokens one step's own memory was 3.91 GiB without checkpointing and
1.72 GiB with it, and without it the activations grow linearly past that (11.26 GiB of accounting
at 8,192 tokens against 1.06 GiB), while the recompute costs about one more forward (a third of a
step). From 4K tokens the memory is worth more than the time; below it, a small model fits either way."""


ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")
_YARN_KEYS = ("beta_fast", "beta_slow", "attention_factor")
_LLAMA3_KEYS = ("low_freq_factor", "high_freq_factor")


class RopeScalingConfig(_Section):
    """How rotary positions stretch past the checkpoint's native length; transformers' own rope initialisation
    computes the frequencies from these keys (written into the model config's `rope_parameters`)."""

    type: str = Field(..., description="linear (position interpolation, LongLoRA), dynamic (NTK, inference-time), yarn or llama3.")
    factor: Literal["auto"] | float = Field(
        "auto", description="Stretch of the native positions; auto: the smallest that covers data.max_seq_len."
    )
    original_max_position_embeddings: int | None = Field(
        None, ge=1, description="Native length the factor refers to; default: the checkpoint's max_position_embeddings."
    )
    beta_fast: float | None = Field(None, gt=0, description="yarn: rotations above which frequencies are kept (transformers' default 32).")
    beta_slow: float | None = Field(None, gt=0, description="yarn: rotations below which frequencies are interpolated (default 1).")
    attention_factor: float | None = Field(None, gt=0, description="yarn: attention temperature; default 0.1 ln(factor) + 1.")
    low_freq_factor: float | None = Field(None, gt=0, description="llama3: wavelengths above native / this are interpolated (default 1).")
    high_freq_factor: float | None = Field(None, gt=0, description="llama3: wavelengths below native / this are kept (default 4).")

    @field_validator("type")
    @classmethod
    def _supported_type(cls, value: str) -> str:
        if value == "longrope":
            raise ValueError("longrope needs per-dimension factor lists searched for one model; not supported here, "
                             f"choose one of {', '.join(ROPE_TYPES)}")
        if value not in ROPE_TYPES:
            raise ValueError(f"unknown rope scaling type {value!r}; choose one of {', '.join(ROPE_TYPES)}")
        return value

    @field_validator("factor")
    @classmethod
    def _stretches(cls, value: Any) -> Any:
        if value != "auto" and value <= 1.0:
            raise ValueError(f"factor must be above 1 (1 is no scaling: remove model.rope_scaling), got {value:g}")
        return value

    @model_validator(mode="after")
    def _keys_of_its_type(self) -> "RopeScalingConfig":
        for keys, owner in ((_YARN_KEYS, "yarn"), (_LLAMA3_KEYS, "llama3")):
            given = [key for key in keys if getattr(self, key) is not None]
            if given and self.type != owner:
                raise ValueError(f"{', '.join(given)} {'is a' if len(given) == 1 else 'are'} {owner} key"
                                 f"{'' if len(given) == 1 else 's'}; type is {self.type}")
        low, high = self.llama3_band
        if self.type == "llama3" and high <= low:
            raise ValueError(f"high_freq_factor ({high:g}) must be above low_freq_factor ({low:g})")
        return self

    @property
    def llama3_band(self) -> tuple[float, float]:
        """(low_freq_factor, high_freq_factor) with Llama 3.1's values (1, 4) where unset."""
        return (self.low_freq_factor or 1.0, self.high_freq_factor or 4.0)


class ModelConfig(_Section):
    path: str = Field(..., description="Local directory of a Hugging Face causal LM checkpoint, or a hub id (owner/name; needs the network).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype; auto picks bfloat16 where the device supports it, else float32."
    )
    attn_implementation: Literal["sdpa", "eager", "sparsebalance", "flash_attention_2", "flex_attention"] = Field(
        "sparsebalance",
        description="Attention backend; `sparsebalance` is the dynamic block-sparse attention the balancer tunes."
        " `sdpa` is the dense baseline (balance.tuning then turns off unless set).",
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description=f"Recompute activations in backward to save memory. auto: on when data.max_seq_len >="
        f" {CHECKPOINTING_FROM_TOKENS:,} tokens, where activations outgrow the weights (docs/recipe.md).",
    )
    rope_scaling: RopeScalingConfig | None = Field(
        None, description="Rotary position scaling to read past the native length (see `model.rope_scaling:`)."
    )
    rope_theta: float | None = Field(None, gt=0, description="Rotary base replacing the checkpoint's (ProLong-style extension), alone or with scaling.")


class LoraConfig(_Section):
    enabled: bool = Field(True, description="Train a LoRA adapter (off: the base model is not trained, e.g. for evaluation).")
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: int = Field(16, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], description="Module names that get adapters."
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full beside the adapter, e.g. embed_tokens and norms as LongLoRA found necessary.",
    )
    train_embeddings_and_norms: bool = Field(
        False, description="Train the input embeddings and every norm in full beside LoRA (LongLoRA); names found in the model."
    )


class DataConfig(_Section):
    path: str = Field(
        ...,
        description="JSONL or Parquet file, folder of text files, a `save_to_disk` dataset folder, or a Hub dataset id (owner/name, needs network).",
    )
    format: Literal["auto", "jsonl", "parquet", "text", "saved", "hub"] = Field("auto", description="Detected from the path when auto.")
    text_field: str = Field("text", description="Field holding each document's text (JSONL, Parquet, saved datasets).")
    messages_field: str | None = Field(None, description="Field holding chat messages; rendered with the chat template.")
    text_glob: str = Field("**/*", description="Which files of a text folder to read.")
    tokenizer: str | None = Field(None, description="Tokenizer directory; defaults to the model's.")
    max_seq_len: int = Field(4096, ge=8, description="Longest sequence in tokens; longer ones follow `too_long`.")
    min_seq_len: int = Field(16, ge=2, description="Shorter documents are dropped (and counted).")
    too_long: Literal["truncate", "drop", "error"] = Field(
        "truncate", description="What to do with a document over max_seq_len (counted and logged either way)."
    )
    max_documents: int | None = Field(None, ge=1, description="Read at most this many documents.")
    cache_dir: str = Field(".sbft_cache", description="Where tokenized datasets are cached and reused.")
    train_on: Literal["all", "assistant"] = Field(
        "all", description="`assistant`: loss only on assistant turns of chat data (needs messages_field); `all`: every token."
    )
    eval_path: str | None = Field(None, description="Validation data, in any form data.path takes (same fields and length policy).")
    eval_split: float | None = Field(
        None, gt=0.0, lt=1.0, description="Hold out this share of the training documents for validation (chosen by training.seed, never trained on)."
    )

    @model_validator(mode="after")
    def _data_options_agree(self) -> "DataConfig":
        if self.train_on == "assistant" and self.messages_field is None:
            raise ValueError("train_on: assistant needs chat data (set messages_field)")
        if self.eval_path is not None and self.eval_split is not None:
            raise ValueError("eval_path and eval_split are alternatives: set one")
        return self


class TrainingConfig(_Section):
    output_dir: str = Field("runs/default", description="Metrics, checkpoints, TensorBoard logs and the final adapter.")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; if unset, `epochs` passes over the data.")
    epochs: int = Field(1, ge=1, description="Passes over the data when max_steps is unset.")
    docs_per_rank: int = Field(4, ge=1, description="Documents per rank per optimizer step (the step's window is this x world size).")
    micro_batch_tokens: int | None = Field(None, ge=8, description="Token cap of one packed micro-batch; default max_seq_len.")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer over the trainable parameters.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field("cosine", description="Decay after warm-up, to zero at the last step.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping norm; null disables clipping.")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto", description="Autocast precision; auto is bf16 on GPUs that support it, none on CPU."
    )
    seed: int = Field(0, description="Seeds the adapter initialisation and the data order.")
    log_every: int = Field(1, ge=1, description="Steps between printed progress lines (metrics.jsonl gets every step).")
    checkpoint_every: int | None = Field(None, ge=1, description="Steps between checkpoints; none disables them.")
    keep_checkpoints: int = Field(2, ge=1, description="Most recent checkpoints kept; older ones are deleted.")
    tensorboard: bool = Field(True, description="Deprecated: `false` removes tensorboard from report_to.")
    report_to: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Trackers (accelerate): tensorboard (under OUTPUT_DIR/tensorboard), wandb, mlflow, ...; `none` for none.",
    )
    eval_every: int | None = Field(
        None, ge=1, description="Steps between validation losses (with data.eval_path or eval_split); also after the last step."
    )
    collective_timeout: int = Field(
        1800, ge=1, description="Seconds a rank waits in a collective for the others before the run fails (a hung rank)."
    )

    sharding: Literal["none", "fsdp"] = Field(
        "none", description="`fsdp`: shard the model, gradients and optimizer state over the ranks (FSDP2, each decoder layer and the root); see docs/sharding.md."
    )
    fsdp_reshard_after_forward: bool = Field(
        True, description="With sharding: fsdp, free each layer's gathered parameters after its forward (less memory, one more all-gather in backward)."
    )
    fsdp_cpu_offload: bool = Field(
        False, description="With sharding: fsdp, keep the parameter shards, gradients and optimizer state in CPU memory between uses."
    )
    loss: Literal["auto", "full", "chunked", "fused"] = Field(
        "auto", description="Next-token loss: full logits, chunked through the LM head, or fused (liger-kernel, CUDA); auto is fused where available, else chunked."
    )
    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value: Any) -> Any:
        """`report_to: wandb` and `report_to: none` as users write them in other trainers."""
        if value is None or value == "none":
            return []
        values = [value] if isinstance(value, str) else value
        return [name for name in values if name != "none"] if isinstance(values, list) else values


class Recipe(_Section):
    model: ModelConfig
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    sparsity: SparsityConfig = Field(default_factory=SparsityConfig)
    balance: BalanceConfig = Field(default_factory=BalanceConfig)

    @model_validator(mode="after")
    def _sections_agree(self) -> "Recipe":
        cap = self.training.micro_batch_tokens
        if cap is not None and cap < self.data.max_seq_len:
            raise ValueError(
                f"training.micro_batch_tokens ({cap}) is below data.max_seq_len ({self.data.max_seq_len}):"
                " a full-length sequence would fit in no micro-batch"
            )
        if self.balance.tuning != "none" and self.model.attn_implementation != "sparsebalance":
            if "tuning" not in self.balance.model_fields_set:
                self.balance.tuning = "none"  # the dense baseline: no budget to tune, so the default tuning steps aside
        if self.balance.tuning != "none" and self.model.attn_implementation != "sparsebalance":
            raise ValueError(
                f"balance.tuning '{self.balance.tuning}' tunes the sparse attention's budget;"
                " it needs model.attn_implementation: sparsebalance (a dense baseline leaves balance.tuning unset)"
            )
        if self.training.eval_every is not None and self.data.eval_path is None and self.data.eval_split is None:
            raise ValueError("training.eval_every needs validation data: set data.eval_path or data.eval_split")
        if self.training.sharding == "fsdp" and self.training.mixed_precision == "fp16":
            raise ValueError(
                "training.sharding: fsdp computes in bf16 or float32: set training.mixed_precision to bf16, no or auto"
            )
        try:
            self.balance.check_default_budget(self.sparsity.budget)
        except UserError as error:
            raise ValueError(str(error)) from None
        return self

    @property
    def uses_gradient_checkpointing(self) -> bool:
        """`model.gradient_checkpointing` resolved: `auto` is on from `CHECKPOINTING_FROM_TOKENS` tokens."""
        setting = self.model.gradient_checkpointing
        return self.data.max_seq_len >= CHECKPOINTING_FROM_TOKENS if setting == "auto" else bool(setting)

    @property
    def token_cap(self) -> int:
        return self.training.micro_batch_tokens or self.data.max_seq_len

    def fingerprint(self) -> str:
        """Short hash of the validated recipe, recorded in profiles and checkpoints."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into a key path and a YAML-typed value (`3` is an int, `[1,2]` a list)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. training.max_steps=10")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RecipeError(f"--set {item!r}: '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def _describe(error: ValidationError, source: str) -> str:
    first = error.errors()[0]
    kind = first["type"]
    if kind == "extra_forbidden":
        message = "unknown key"
    elif kind == "missing":
        message = "required key is missing"
    else:
        message = first["msg"].removeprefix("Value error, ")
        if "input" in first and not isinstance(first["input"], dict):
            message += f" (got {first['input']!r})"
    key = ".".join(str(p) for p in first["loc"])
    more = len(error.errors()) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{source}: {key + ': ' if key else ''}{message}{suffix}"


def recipe_from_dict(data: Any, source: str = "recipe") -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: expected a mapping of sections at the top level, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as error:
        raise RecipeError(_describe(error, source)) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None, check_paths: bool = True) -> Recipe:
    """Read, override and validate a recipe; with `check_paths`, also require the model and data to exist."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise RecipeError(f"{path}{where}: not valid YAML: {problem}") from None
    if data is not None and not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    data = apply_overrides(data if data is not None else {}, overrides or [])
    recipe = recipe_from_dict(data, str(path))
    if check_paths:
        check_recipe_paths(recipe)
    return recipe


def check_recipe_paths(recipe: Recipe) -> None:
    """Fail early, naming the key, when a local path the recipe points at does not exist."""
    for key, value in (
        ("model.path", recipe.model.path),
        ("data.path", recipe.data.path),
        ("data.eval_path", recipe.data.eval_path),
        ("data.tokenizer", recipe.data.tokenizer),
        ("balance.profile", recipe.balance.profile),
    ):
        if value is not None and not Path(value).exists():
            if key != "balance.profile" and is_hub_id(value):
                continue  # a hub id: loading says in one line if the hub cannot be reached
            raise RecipeError(f"{key}: path not found: {value}")


def changed_settings(recipe: Recipe) -> dict[str, Any]:
    """`section.key -> value` for every key that differs from the schema's default (the paths excepted)."""
    changed = {}
    for section, field in Recipe.model_fields.items():
        values = getattr(recipe, section)
        for key, item in type(values).model_fields.items():
            if item.is_required():
                continue
            value = getattr(values, key)
            if value != item.get_default(call_default_factory=True):
                # a nested setting (model.rope_scaling) shows the keys the recipe set, not every unset one
                changed[f"{section}.{key}"] = value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value
    return changed


def describe_setup(recipe: Recipe) -> list[str]:
    """Two lines printed when training starts: the method as it will run, and what the recipe changed."""
    balance, sparsity = recipe.balance, recipe.sparsity
    if recipe.model.attn_implementation == "sparsebalance":
        attention = f"sparse attention (budget {sparsity.budget:g}"
        attention += f", tuned within {balance.min_budget:g}..{balance.max_budget:g})" if balance.tuning != "none" else ", fixed)"
        tuning = "tuning off" if balance.tuning == "none" else f"tuning {balance.tuning} (target {balance.target})"
    else:
        attention, tuning = f"dense attention ({recipe.model.attn_implementation})", "tuning off (nothing to tune)"
    checkpointing = "on" if recipe.uses_gradient_checkpointing else "off"
    if recipe.model.gradient_checkpointing == "auto":
        checkpointing += f" (auto: max_seq_len {recipe.data.max_seq_len:,} {'>=' if recipe.uses_gradient_checkpointing else '<'} {CHECKPOINTING_FROM_TOKENS:,})"
    changed = ", ".join(f"{key}={value}" for key, value in changed_settings(recipe).items()) or "none"
    return [
        f"setup: {attention}, batching {balance.batching}, {tuning}, gradient checkpointing {checkpointing}",
        f"changed from the defaults: {changed}",
    ]


def dump_recipe(recipe: Recipe, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))


def _type_name(annotation) -> str:
    literals = [a for a in typing.get_args(annotation) if isinstance(a, str)]
    if not literals:  # `Literal[...] | None` and `bool | Literal["auto"]` nest the literal one level down
        members = typing.get_args(annotation)
        literals = [a for sub in members for a in typing.get_args(sub) if isinstance(a, str)]
        if literals:
            literals += [sub.__name__ for sub in members if sub is not type(None) and isinstance(sub, type)]
            literals += ["None"] if type(None) in members else []
    text = " | ".join(literals) if literals else str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.replace("|", "\\|")


def _nested_section(annotation) -> type[_Section] | None:
    """The section model inside `Section | None`, for keys that hold a mapping of their own."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, _Section):
            return candidate
    return None


def _reference_table(title: str, section: type[_Section]) -> list[str]:
    lines = [f"### `{title}:`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    for key, item in section.model_fields.items():
        default = "required" if item.is_required() else (item.default_factory() if item.default_factory else item.default)
        inner = _nested_section(item.annotation)
        kind = "mapping (below)" if inner else _type_name(item.annotation)
        if inner:
            nested.append((f"{title}.{key}", inner))
        lines.append(f"| `{key}` | {kind} | `{default}` | {item.description or ''} |")
    lines.append("")
    for name, inner in nested:
        lines += _reference_table(name, inner)
    return lines


def reference_markdown() -> str:
    """docs/recipe.md's key reference, generated from the schema (tests/test_readme.py keeps the page equal to it)."""
    lines = []
    for section, field in Recipe.model_fields.items():
        lines += _reference_table(section, field.annotation)
    return "\n".join(lines)
