"""Latency cost models: predicted forward+backward seconds from document lengths and densities.

The cost model is the only thing batching, the balancer and the simulator consult for time.
Every model answers the same three questions (the `CostModel` protocol):

- `doc_times(lengths, densities)`: seconds each document adds to a micro-batch (its attention
  in every layer plus its share of the token-linear work), vectorised over documents; this is
  what partitioning policies sum and compare.
- `micro_batch_time(lengths, densities)`: seconds of one packed micro-batch: the attention of
  each document, the token-linear work (embeddings, projections, MLPs, LM head, loss) on the
  micro-batch's total tokens, plus a fixed per-micro-batch overhead.
- `step_overhead`: seconds per optimizer step that no document causes (the optimizer step).

Densities are the share of causal key blocks the sparse attention keeps (1.0 is dense). They
may be given per document, shape `(n,)`, applying to every sparse layer (layers listed in
`SparsityConfig.dense_layers` always count as 1.0), or per document and layer, shape
`(n, num_layers)`, for per-layer budgets. A scalar broadcasts.

Two implementations:

- `AnalyticCostModel`: FLOP counts at an assumed achieved FLOP/s, for what-if simulation of real
  model sizes and as the stand-in when no profile exists (`from_hf_config`, `llama_8b`).
- `ProfiledCostModel`: interpolates a profile measured by `sbft profile` on the hardware it
  runs on (log length x density for attention, tokens for the linear part).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from ..errors import UserError

PROFILE_FORMAT = "sparsebalance-ft/latency-profile"
PROFILE_VERSION = 1


class ProfileError(UserError):
    """A profile file that cannot be used (missing, unreadable, wrong format)."""


class OutOfProfileError(UserError):
    """A prediction was asked beyond the profiled grid while extrapolation is refused."""


class ProfileMismatchWarning(UserWarning):
    """The profile was measured on other hardware, another model or another timing setup."""


class ProfileExtrapolationWarning(UserWarning):
    """A prediction was asked beyond the profiled grid; the answer is extrapolated."""


@runtime_checkable
class CostModel(Protocol):
    """What batching, balancer and simulator ask of a latency model (all times in seconds)."""

    num_layers: int
    step_overhead: float

    def doc_times(self, lengths: np.ndarray, densities: np.ndarray | float) -> np.ndarray:
        """Seconds each document adds to a micro-batch (forward+backward), shape `(n,)`."""
        ...

    def micro_batch_time(self, lengths: np.ndarray, densities: np.ndarray | float) -> float:
        """Seconds of one packed micro-batch (forward+backward, no optimizer step)."""
        ...


# --------------------------------------------------------------------------- helpers


def _as_lengths(lengths: Any) -> np.ndarray:
    return np.asarray(lengths, dtype=np.float64).reshape(-1)


def _layer_densities(densities: Any, n: int, num_layers: int, dense_mask: np.ndarray) -> tuple[np.ndarray, bool]:
    """Normalise densities to `(n,)` (shared by sparse layers) or `(n, num_layers)`; clip to [0, 1]."""
    d = np.asarray(densities, dtype=np.float64)
    if d.ndim == 0:
        return np.full(n, float(np.clip(d, 0.0, 1.0))), False
    if d.ndim == 1:
        if d.shape[0] != n:
            raise ValueError(f"densities has {d.shape[0]} entries for {n} documents")
        return np.clip(d, 0.0, 1.0), False
    if d.ndim == 2:
        if d.shape != (n, num_layers):
            raise ValueError(f"per-layer densities must have shape ({n}, {num_layers}), got {d.shape}")
        d = np.clip(d, 0.0, 1.0).copy()
        d[:, dense_mask] = 1.0
        return d, True
    raise ValueError(f"densities must be a scalar, (n,) or (n, num_layers), got shape {d.shape}")


def _dense_mask(num_layers: int, dense_layers: Any) -> np.ndarray:
    mask = np.zeros(num_layers, dtype=bool)
    for i in dense_layers or ():
        if -num_layers <= int(i) < num_layers:
            mask[int(i)] = True
    return mask


# --------------------------------------------------------------------------- analytic


@dataclass
class AnalyticCostModel:
    """FLOP-based cost: `linear_flops_per_token * L / flops_per_s + attn_flops_coeff * d * L^2 / attn_flops_per_s`.

    `attn_flops_coeff` is the whole model's forward+backward attention FLOPs per unit density per
    squared token (causal already accounted); it is split evenly over `num_layers`, and layers in
    `dense_layers` always count at density 1.0.
    """

    num_layers: int
    linear_flops_per_token: float
    attn_flops_coeff: float
    flops_per_s: float = 4.0e14
    attn_flops_per_s: float | None = None
    micro_batch_overhead: float = 0.0
    step_overhead: float = 0.0
    dense_layers: list[int] = field(default_factory=list)
    name: str = "analytic"

    def __post_init__(self) -> None:
        self._dense = _dense_mask(self.num_layers, self.dense_layers)
        self._attn_rate = float(self.attn_flops_per_s or self.flops_per_s)

    # presets -------------------------------------------------------------
    @classmethod
    def llama_8b(cls, flops_per_s: float = 4.0e14, **kwargs: Any) -> "AnalyticCostModel":
        """The brief's Llama-8B-like model: 6 x 8e9 FLOP per token, attention 9.2e5 x d x L^2."""
        return cls(num_layers=32, linear_flops_per_token=6 * 8.0e9, attn_flops_coeff=9.2e5,
                   flops_per_s=flops_per_s, name="llama-8b", **kwargs)

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        flops_per_s: float = 4.0e14,
        attn_flops_per_s: float | None = None,
        train_flops_factor: float = 6.0,
        attn_flops_factor: float = 7.0,
        dense_layers: list[int] | None = None,
        **kwargs: Any,
    ) -> "AnalyticCostModel":
        """Counts from a Hugging Face decoder config (a `PretrainedConfig` or its dict).

        Linear: `train_flops_factor` (6: forward 2, backward 4; about 4 with frozen LoRA bases)
        x the matmul parameters (projections, MLP, LM head). Attention: `attn_flops_factor` (7:
        forward QK and PV, backward twice that plus the recomputed scores) x layers x query
        heads x head_dim x d x L^2 / ... with the causal half already folded into the factor.
        """
        get = config.get if isinstance(config, dict) else (lambda k, default=None: getattr(config, k, default))
        if get("text_config") is not None:  # multimodal wrappers
            inner = get("text_config")
            return cls.from_hf_config(inner if isinstance(inner, dict) else inner, flops_per_s, attn_flops_per_s,
                                      train_flops_factor, attn_flops_factor, dense_layers, **kwargs)
        layers = int(get("num_hidden_layers"))
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        kv_heads = int(get("num_key_value_heads") or heads)
        head_dim = int(get("head_dim") or hidden // heads)
        inter = int(get("intermediate_size") or 4 * hidden)
        vocab = int(get("vocab_size") or 0)
        per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * inter
        params = layers * per_layer + vocab * hidden
        coeff = attn_flops_factor * layers * heads * head_dim
        name = str(get("model_type") or "hf") + f"-{params / 1e9:.2g}B"
        return cls(num_layers=layers, linear_flops_per_token=train_flops_factor * params, attn_flops_coeff=coeff,
                   flops_per_s=flops_per_s, attn_flops_per_s=attn_flops_per_s,
                   dense_layers=list(dense_layers or []), name=name, **kwargs)

    # predictions ---------------------------------------------------------
    def _effective_density(self, densities: Any, n: int) -> np.ndarray:
        d, per_layer = _layer_densities(densities, n, self.num_layers, self._dense)
        if per_layer:
            return d.mean(axis=1)
        n_dense = int(self._dense.sum())
        return (d * (self.num_layers - n_dense) + n_dense) / self.num_layers

    def attention_times(self, lengths: np.ndarray, densities: np.ndarray | float) -> np.ndarray:
        L = _as_lengths(lengths)
        d = self._effective_density(densities, L.shape[0])
        return self.attn_flops_coeff * d * L * L / self._attn_rate

    def linear_time(self, tokens: float | np.ndarray) -> np.ndarray | float:
        return self.linear_flops_per_token * np.asarray(tokens, dtype=np.float64) / self.flops_per_s

    def doc_times(self, lengths: np.ndarray, densities: np.ndarray | float) -> np.ndarray:
        L = _as_lengths(lengths)
        return self.linear_flops_per_token * L / self.flops_per_s + self.attention_times(L, densities)

    def micro_batch_time(self, lengths: np.ndarray, densities: np.ndarray | float) -> float:
        L = _as_lengths(lengths)
        if L.size == 0:
            return 0.0
        return float(self.doc_times(L, densities).sum() + self.micro_batch_overhead)

    def describe(self) -> dict[str, Any]:
        return {"kind": "analytic", "name": self.name, "num_layers": self.num_layers,
                "linear_flops_per_token": self.linear_flops_per_token, "attn_flops_coeff": self.attn_flops_coeff,
                "flops_per_s": self.flops_per_s, "attn_flops_per_s": self._attn_rate}


# --------------------------------------------------------------------------- environment identity


def current_hardware() -> dict[str, Any]:
    """What a profile is only valid for: device kind and name, CPU model, cores, torch threads."""
    import torch

    cpu = _cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, Any] = {"machine": platform.machine(), "cpu": cpu, "cpu_count": cores,
                            "torch_threads": torch.get_num_threads(), "device": "cpu", "device_name": cpu}
    if torch.cuda.is_available():
        info.update(device="cuda", device_name=torch.cuda.get_device_name(torch.cuda.current_device()),
                    device_count=torch.cuda.device_count())
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


HARDWARE_KEYS = ("device", "device_name", "cpu", "cpu_count")


def library_versions() -> dict[str, str]:
    """Installed versions of what a profile's timings depend on ("missing" for one not installed)."""
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "numpy", "sparsebalance_ft"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def model_config_hash(config: Any) -> str:
    """Short hash of the architecture fields of a HF config (not names, dtypes or paths)."""
    data = config if isinstance(config, dict) else config.to_dict()
    keep = {k: v for k, v in sorted(data.items()) if k not in {
        "_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation",
        "_attn_implementation_autoset", "architectures", "use_cache", "output_attentions"}
        and isinstance(v, (int, float, str, bool, type(None), list))}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def timing_key(recipe: Any) -> str:
    """Hash of the recipe settings that change timing: model, LoRA, sparsity (not budget), precision."""
    sparsity = recipe.sparsity.model_dump(mode="json")
    sparsity.pop("budget", None)
    sparsity.pop("recall_samples", None)
    data = {
        "model": recipe.model.model_dump(mode="json"),
        "lora": recipe.lora.model_dump(mode="json"),
        "sparsity": sparsity,
        "mixed_precision": recipe.training.mixed_precision,
        "optimizer": recipe.training.optimizer,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- profiled


@dataclass
class ProfiledCostModel:
    """Interpolates a measured profile.

    Attention per layer and document, `attn[i, j]` seconds at `lengths[i]` tokens and density
    `densities[j]` (per-call overhead removed): linear in density, then piecewise power law in
    length (linear interpolation of log time over log length). Token-linear part of the whole
    model, `linear[k]` seconds at `tokens[k]`: piecewise linear. `attn_call_overhead` is paid once
    per layer per micro-batch; `micro_batch_overhead` once per micro-batch; `doc_overhead` once per
    document (the last two calibrated on packed micro-batches by the profiler).

    `dense_attn[i]`, when present, is the attention at `lengths[i]` on the backend's separate
    exact-dense path (the sparse attention computes budget 1.0 with fused dense SDPA, which costs
    differently from keeping every block in the block-sparse kernel): density 1.0 uses it, and
    `densities` then holds the block-sparse grid (below 1.0).

    `attention_scope` says what the backend's attention costs in a packed micro-batch:
    "document" (block-sparse or varlen kernels: each document attends within itself) or
    "micro_batch" (dense kernels with a block-diagonal mask, e.g. sdpa/eager: the whole packed
    sequence's L^2 is computed whatever the documents).

    Beyond the longest profiled length the power law of the last segment extrapolates and
    `extrapolate` decides: "warn" (once per model), "error" (`OutOfProfileError`) or "allow".
    Shorter documents than the shortest profiled length extrapolate silently (tiny cost).
    """

    lengths: np.ndarray
    densities: np.ndarray
    attn: np.ndarray
    tokens: np.ndarray
    linear: np.ndarray
    num_layers: int
    dense_layers: list[int] = field(default_factory=list)
    attn_call_overhead: float = 0.0
    micro_batch_overhead: float = 0.0
    step_overhead: float = 0.0
    doc_overhead: float = 0.0
    extrapolate: Literal["warn", "error", "allow"] = "warn"
    attention_scope: Literal["document", "micro_batch"] = "document"
    dense_attn: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    _FLOOR = 1e-9

    def __post_init__(self) -> None:
        self.lengths = np.asarray(self.lengths, dtype=np.float64)
        self.densities = np.asarray(self.densities, dtype=np.float64)
        self.attn = np.maximum(np.asarray(self.attn, dtype=np.float64), self._FLOOR)
        self.tokens = np.asarray(self.tokens, dtype=np.float64)
        self.linear = np.asarray(self.linear, dtype=np.float64)
        if self.attn.shape != (self.lengths.size, self.densities.size):
            raise ProfileError(f"attention table has shape {self.attn.shape}, grid is "
                               f"{self.lengths.size} lengths x {self.densities.size} densities")
        if self.lengths.size < 2 or np.any(np.diff(self.lengths) <= 0):
            raise ProfileError("profile lengths must be at least two increasing values")
        if np.any(np.diff(self.densities) <= 0):
            raise ProfileError("profile densities must be increasing")
        if self.tokens.size < 2 or self.tokens.shape != self.linear.shape or np.any(np.diff(self.tokens) <= 0):
            raise ProfileError("profile linear part needs at least two increasing token counts")
        if self.dense_attn is not None:
            self.dense_attn = np.maximum(np.asarray(self.dense_attn, dtype=np.float64).reshape(-1), self._FLOOR)
            if self.dense_attn.shape != self.lengths.shape:
                raise ProfileError(f"dense attention column has {self.dense_attn.size} values for "
                                   f"{self.lengths.size} lengths")
        self._logL = np.log(self.lengths)
        self._dense = _dense_mask(self.num_layers, self.dense_layers)
        self._n_dense = int(self._dense.sum())
        self._n_sparse = self.num_layers - self._n_dense
        slope = (self.linear[1] - self.linear[0]) / (self.tokens[1] - self.tokens[0])
        self._lin_intercept = float(self.linear[0] - slope * self.tokens[0])
        self._warned = False

    # ---------------------------------------------------------------- core interpolation
    def _check_range(self, L: np.ndarray) -> None:
        if L.size == 0 or self.extrapolate == "allow":
            return
        longest = float(L.max())
        if longest > self.lengths[-1] * 1.0001:
            message = (f"document length {int(longest)} is beyond the profiled grid (max {int(self.lengths[-1])});"
                       " the prediction extrapolates the last segment's power law. Profile with a larger"
                       " data.max_seq_len to cover it.")
            if self.extrapolate == "error":
                raise OutOfProfileError(message)
            if not self._warned:
                self._warned = True
                warnings.warn(message, ProfileExtrapolationWarning, stacklevel=3)

    def layer_attention(self, lengths: np.ndarray, densities: np.ndarray | float) -> np.ndarray:
        """Seconds of one layer's attention per document (no per-call overhead), vectorised."""
        L = _as_lengths(lengths)
        d = np.broadcast_to(np.clip(np.asarray(densities, dtype=np.float64), 0.0, 1.0), L.shape)
        nL, nD = self.lengths.size, self.densities.size
        x = np.log(np.maximum(L, 1.0))
        i = np.clip(np.searchsorted(self._logL, x, side="right") - 1, 0, nL - 2)
        t = (x - self._logL[i]) / (self._logL[i + 1] - self._logL[i])
        if self.dense_attn is not None:
            dense = np.exp((1.0 - t) * np.log(self.dense_attn[i]) + t * np.log(self.dense_attn[i + 1]))
            if np.all(d >= 1.0):
                return dense
        if nD == 1:
            v0 = self.attn[i, 0]
            v1 = self.attn[i + 1, 0]
        else:
            j = np.clip(np.searchsorted(self.densities, d, side="right") - 1, 0, nD - 2)
            s = (d - self.densities[j]) / (self.densities[j + 1] - self.densities[j])
            v0 = self.attn[i, j] + s * (self.attn[i, j + 1] - self.attn[i, j])
            v1 = self.attn[i + 1, j] + s * (self.attn[i + 1, j + 1] - self.attn[i + 1, j])
            # below the lowest profiled density: linear extrapolation, kept positive
            v0 = np.maximum(v0, 0.25 * self.attn[i, 0])
            v1 = np.maximum(v1, 0.25 * self.attn[i + 1, 0])
        out = np.exp((1.0 - t) * np.log(v0) + t * np.log(v1))
        if self.dense_attn is not None:
            out = np.where(d >= 1.0, dense, out)
        return out

    def attention_times(self, lengths: np.ndarray, densities: np.ndarray | float) -> np.ndarray:
        """Seconds of the whole model's attention per document (all layers), shape `(n,)`."""
        L = _as_lengths(lengths)
        self._check_range(L)
        d, per_layer = _layer_densities(densities, L.shape[0], self.num_layers, self._dense)
        if per_layer:
            total = np.zeros_like(L)
            for layer in range(self.num_layers):
                total += self.layer_attention(L, d[:, layer])
            return total
        out = self._n_sparse * self.layer_attention(L, d) if self._n_sparse else np.zeros_like(L)
        if self._n_dense:
            out = out + self._n_dense * self.layer_attention(L, 1.0)
        return out

    def linear_time(self, tokens: float | np.ndarray) -> np.ndarray | float:
        """Seconds of the token-linear part of one micro-batch of `tokens` tokens (whole model)."""
        T = np.asarray(tokens, dtype=np.float64)
        out = np.interp(T, self.tokens, self.linear)
        hi = T > self.tokens[-1]
        if np.any(hi):
            slope = (self.linear[-1] - self.linear[-2]) / (self.tokens[-1] - self.tokens[-2])
            out = np.where(hi, self.linear[-1] + slope * (T - self.tokens[-1]), out)
        lo = T < self.tokens[0]
        if np.any(lo):
            slope = (self.linear[1] - self.linear[0]) / (self.tokens[1] - self.tokens[0])
            out = np.where(lo, np.maximum(self.linear[0] + slope * (T - self.tokens[0]), 0.0), out)
        return out if out.ndim else float(out)

    # ---------------------------------------------------------------- protocol
    def doc_times(self, lengths: np.ndarray, densities: np.ndarray | float) -> np.ndarray:
        L = _as_lengths(lengths)
        linear = np.asarray(self.linear_time(L)) - self._lin_intercept
        return np.maximum(linear, 0.0) + self.attention_times(L, densities) + self.doc_overhead

    def micro_batch_time(self, lengths: np.ndarray, densities: np.ndarray | float) -> float:
        L = _as_lengths(lengths)
        if L.size == 0:
            return 0.0
        if self.attention_scope == "micro_batch":
            d = np.broadcast_to(np.asarray(densities, dtype=np.float64), L.shape) if np.ndim(densities) < 2 \
                else np.asarray(densities, dtype=np.float64).mean(axis=1)
            mean_d = float((d * L * L).sum() / max((L * L).sum(), 1.0))
            attention = float(self.attention_times(np.array([L.sum()]), mean_d)[0])
        else:
            attention = float(self.attention_times(L, densities).sum())
        return (attention + float(self.linear_time(L.sum())) + self.num_layers * self.attn_call_overhead
                + self.micro_batch_overhead + self.doc_overhead * L.size)

    # ---------------------------------------------------------------- files
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "meta": self.meta,
            "num_layers": self.num_layers,
            "dense_layers": list(self.dense_layers),
            "attention": {"lengths": self.lengths.tolist(), "densities": self.densities.tolist(),
                          "seconds_per_layer": self.attn.tolist(), "call_overhead": self.attn_call_overhead,
                          "dense_seconds_per_layer": None if self.dense_attn is None else self.dense_attn.tolist()},
            "linear": {"tokens": self.tokens.tolist(), "seconds": self.linear.tolist()},
            "attention_scope": self.attention_scope,
            "micro_batch_overhead": self.micro_batch_overhead,
            "doc_overhead": self.doc_overhead,
            "step_overhead": self.step_overhead,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data: dict[str, Any], extrapolate: Literal["warn", "error", "allow"] = "warn",
                  source: str = "profile") -> "ProfiledCostModel":
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{source}: not a latency profile written by `sbft profile`")
        if int(data.get("version", 0)) > PROFILE_VERSION:
            raise ProfileError(f"{source}: profile version {data.get('version')} is newer than this sbft understands")
        try:
            att, lin = data["attention"], data["linear"]
            return cls(lengths=att["lengths"], densities=att["densities"], attn=att["seconds_per_layer"],
                       tokens=lin["tokens"], linear=lin["seconds"], num_layers=int(data["num_layers"]),
                       dense_layers=list(data.get("dense_layers", [])),
                       attn_call_overhead=float(att.get("call_overhead", 0.0)),
                       micro_batch_overhead=float(data.get("micro_batch_overhead", 0.0)),
                       doc_overhead=float(data.get("doc_overhead", 0.0)),
                       step_overhead=float(data.get("step_overhead", 0.0)),
                       extrapolate=extrapolate, attention_scope=data.get("attention_scope", "document"),
                       dense_attn=att.get("dense_seconds_per_layer"),
                       meta=dict(data.get("meta", {})))
        except (KeyError, TypeError, ValueError) as error:
            raise ProfileError(f"{source}: malformed profile ({error})") from None

    @classmethod
    def load(
        cls,
        path: str | Path,
        recipe: Any = None,
        model_config: Any = None,
        hardware: dict[str, Any] | None = None,
        extrapolate: Literal["warn", "error", "allow"] = "warn",
        check: bool = True,
    ) -> "ProfiledCostModel":
        """Read a profile; warn (`ProfileMismatchWarning`) if hardware, model or timing setup differ."""
        path = Path(path)
        if not path.is_file():
            raise ProfileError(f"{path}: profile file not found")
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ProfileError(f"{path}: not readable JSON ({error})") from None
        model = cls.from_dict(data, extrapolate=extrapolate, source=str(path))
        if check:
            problems = model.mismatches(recipe=recipe, model_config=model_config, hardware=hardware)
            if problems:
                warnings.warn(f"latency profile {path} may not fit this run: " + "; ".join(problems)
                              + ". Predictions (and balancing) may be off; re-run `sbft profile` here.",
                              ProfileMismatchWarning, stacklevel=2)
        return model

    def mismatches(self, recipe: Any = None, model_config: Any = None,
                   hardware: dict[str, Any] | None = None) -> list[str]:
        """Human-readable differences between the profile's identity and the current setup."""
        problems: list[str] = []
        recorded = self.meta.get("hardware", {})
        now = hardware if hardware is not None else current_hardware()
        for key in HARDWARE_KEYS:
            if key in recorded and key in now and recorded[key] != now[key]:
                problems.append(f"hardware {key} was {recorded[key]!r}, is {now[key]!r}")
        if model_config is not None and self.meta.get("model_config_hash"):
            if model_config_hash(model_config) != self.meta["model_config_hash"]:
                problems.append("model architecture differs from the profiled one")
        if recipe is not None and self.meta.get("timing_key"):
            if timing_key(recipe) != self.meta["timing_key"]:
                problems.append("recipe's model/LoRA/sparsity/precision settings differ from the profiled recipe")
        return problems

    def describe(self) -> dict[str, Any]:
        return {"kind": "profiled", "num_layers": self.num_layers, "lengths": self.lengths.tolist(),
                "densities": self.densities.tolist(), "hardware": self.meta.get("hardware")}


def load_cost_model(recipe: Any, model_config: Any = None, **kwargs: Any) -> CostModel:
    """The run's cost model: the recipe's `balance.profile` if set, else analytic from the model config.

    Without a profile the analytic model's absolute seconds are rough (assumed FLOP/s); relative
    costs, which is what balancing needs, still follow lengths and densities.
    """
    if recipe.balance.profile:
        return ProfiledCostModel.load(recipe.balance.profile, recipe=recipe, model_config=model_config, **kwargs)
    if model_config is None:
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(recipe.model.path)
    import torch

    flops = 4.0e14 if torch.cuda.is_available() else 5.0e10
    return AnalyticCostModel.from_hf_config(model_config, flops_per_s=flops,
                                            dense_layers=list(recipe.sparsity.dense_layers))


__all__ = [
    "CostModel", "AnalyticCostModel", "ProfiledCostModel", "load_cost_model", "ProfileError",
    "OutOfProfileError", "ProfileMismatchWarning", "ProfileExtrapolationWarning", "current_hardware",
    "library_versions", "model_config_hash", "timing_key", "PROFILE_FORMAT", "PROFILE_VERSION",
]

