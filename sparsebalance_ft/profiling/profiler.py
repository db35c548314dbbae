"""`sbft profile`: measure the recipe's own model, as it trains, into a latency profile.

What is timed (forward+backward, the model in train mode with its LoRA, dtype, attention
backend and gradient checkpointing exactly as `train.model.load_model` builds it):

- one decoder layer (a sparse one, not in `dense_layers`) over a grid of sequence lengths
  (log-spaced up to `data.max_seq_len`) and forced attention densities, and the same layer with
  a no-op attention at each length; their difference is the attention's cost per layer;
- the whole model on one short document and on several packed together, with and without the
  real attention, which separates the attention's fixed per-call cost from its per-document cost;
- the whole model with the no-op attention over a grid of token counts up to the micro-batch
  token cap: everything that does not depend on attention (embeddings, projections, MLPs,
  norms, LM head and loss);
- the optimizer step over the trainable parameters;
- a dozen random packed micro-batches (1 to 100% of the token cap) on which the fixed costs per
  micro-batch and per document that the tables miss are fitted (`calibrate_overheads`).

Every measurement is warmed up once, then repeated in interleaved passes over all cells (a burst
of load from elsewhere hits every cell a little rather than one cell a lot) and reduced to a
median; the tables are then made monotone (isotonic fits) in density, length and tokens.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch

from ..cost.model import (
    ProfiledCostModel,
    current_hardware,
    library_versions,
    model_config_hash,
    timing_key,
)
from ..cost.stats import _isotonic
from ..errors import UserError
from ..train.loss import micro_batch_loss
from ..train.step import synchronize

NOOP_ATTENTION = "sbft_profile_noop"
# Dense kernels given the packed block-diagonal mask compute the whole packed sequence's L^2;
# block-sparse, varlen (flash) and block-mask (flex) kernels only work within documents.
MICRO_BATCH_SCOPED = {"sdpa", "eager"}


class ProfilingError(UserError):
    """The model cannot be profiled as configured (e.g. no decoder layers found)."""


# --------------------------------------------------------------------------- density drivers


class DensityDriver(Protocol):
    """Fixes the attention's density for the next forwards (`None` releases it)."""

    densities_supported: bool

    def force(self, density: float | None) -> None: ...

    def drain(self) -> None: ...


class DenseDriver:
    """Dense backends (sdpa, eager, flash): density is always 1.0."""

    densities_supported = False

    def force(self, density: float | None) -> None:
        return None

    def drain(self) -> None:
        return None


class ControllerDriver:
    """The sparse attention's controller: `force_density(d)` makes every sparse layer keep share d.

    `dense_path`: density 1.0 runs a separate exact-dense kernel (profiled as its own column).
    """

    densities_supported = True

    def __init__(self, controller: Any):
        self.controller = controller
        config = getattr(controller, "config", None)
        self.dense_path = bool(getattr(config, "exact_dense_at_full_budget", False))

    def force(self, density: float | None) -> None:
        self.controller.force_density(density)

    def drain(self) -> None:
        pop = getattr(self.controller, "pop_report", None)
        if pop is not None:
            pop()  # discard the report: profiling forces densities, so there is nothing to learn from it


def attach_driver(model: Any, recipe: Any) -> DensityDriver:
    if recipe.model.attn_implementation != "sparsebalance":
        return DenseDriver()
    try:
        from ..attention import SparseAttentionController  # type: ignore[attr-defined]
    except ImportError as error:  # pragma: no cover - until the attention package lands
        raise ProfilingError(f"model.attn_implementation: sparsebalance attention is not available ({error})") from None
    return ControllerDriver(SparseAttentionController.attach(model, recipe.sparsity))


# --------------------------------------------------------------------------- model plumbing


def _noop_attention(module, query, key, value, attention_mask, **kwargs):
    """Costs O(tokens): keeps the gradient path to q, k and v so their projections' backward runs."""
    extra = (key + value).mean(dim=1, keepdim=True)
    return (query + extra).transpose(1, 2), None


def register_noop_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NOOP_ATTENTION, _noop_attention)


@contextlib.contextmanager
def attention_swapped(model: torch.nn.Module, implementation: str) -> Iterator[None]:
    """Temporarily route every attention module of `model` to another registered implementation."""
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation(implementation)
        yield
    finally:
        model.set_attn_implementation(before)


def model_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise ProfilingError("model has no `config`: not a Hugging Face model")
    return getattr(config, "text_config", None) or config


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    n = int(model_config(model).num_hidden_layers)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise ProfilingError(f"no list of {n} decoder layers found in {type(model).__name__}")


class _Captured(Exception):
    pass


def capture_layer_inputs(model, layer, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[tuple, dict]:
    """Run the model up to `layer` and return the exact arguments it would be called with."""
    store: dict[str, Any] = {}

    def hook(module, args, kwargs):
        store["args"], store["kwargs"] = args, kwargs
        raise _Captured

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "args" not in store:
        raise ProfilingError("could not capture a decoder layer's inputs")
    return store["args"], store["kwargs"]


def packed_inputs(lengths: list[int], vocab: int, device: torch.device, generator: torch.Generator) -> dict:
    total = int(sum(lengths))
    ids = torch.randint(3, max(vocab, 4), (1, total), generator=generator).to(device)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
    labels = ids.clone()
    start = 0
    for n in lengths:
        labels[0, start] = -100
        start += n
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def model_loss(model, batch: dict, loss_mode: str = "auto") -> torch.Tensor:
    """The training loss of a packed micro-batch: the trainer's own (`train.loss.micro_batch_loss`)."""
    return micro_batch_loss(model, batch, loss_mode)[0]


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def _timed(fn: Callable[[], None], device: torch.device, clock: str = "wall") -> float:
    """Seconds of `fn`: wall clock (synchronised on CUDA), or this process's CPU time.

    The CPU clock, with one torch thread, measures the work itself and ignores time the process
    spends descheduled, which keeps profiles reproducible on a CPU shared with other jobs.
    """
    now = CLOCKS[clock]
    synchronize(device)
    start = now()
    fn()
    synchronize(device)
    return now() - start


def _autocast(device: torch.device, mixed_precision: str):
    if device.type == "cuda" and mixed_precision in ("bf16", "fp16"):
        return torch.autocast("cuda", dtype=torch.bfloat16 if mixed_precision == "bf16" else torch.float16)
    return contextlib.nullcontext()


@dataclass
class Cell:
    """One measured quantity: a key, a zero-argument workload, its samples."""

    key: tuple
    run: Callable[[], None]
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return float(np.median(self.samples)) if self.samples else float("nan")

    def value(self, statistic: str = "median") -> float:
        if not self.samples:
            return float("nan")
        return float(np.min(self.samples)) if statistic == "min" else self.median


def measure_cells(cells: list[Cell], device: torch.device, warmup: int, repeats: int,
                  progress: Callable[[str], None] | None = None, clock: str = "wall") -> None:
    """Warm-up pass(es), then `repeats` interleaved passes over every cell.

    The garbage collector is off while cells run, so that no collection pause lands inside a timed run;
    one full collection per pass keeps memory bounded (one per cell cost more than small cells themselves)."""
    gc.disable()
    try:
        for p in range(warmup + repeats):
            gc.collect()
            for cell in cells:
                seconds = _timed(cell.run, device, clock)
                if p >= warmup:
                    cell.samples.append(seconds)
                if progress is not None:
                    progress(str(cell.key[0]))
    finally:
        gc.enable()


def random_micro_batches(count: int, max_len: int, token_cap: int, densities: list[float], seed: int = 0,
                         min_doc: int = 32, dense_share: float = 0.0, fill: tuple[float, float] = (0.3, 1.0),
                         log_fill: bool = False) -> list[tuple[list[int], float]]:
    """Mixed-length packed micro-batches: (document lengths, forced density; 1.0 with `dense_share`).

    Each batch is filled to a random share of `token_cap` in `fill` (log-uniform with `log_fill`).
    """
    rng = np.random.default_rng(seed)
    out = []
    lo, hi = np.log(min_doc), np.log(max_len)
    d_lo, d_hi = min(densities), max(densities)
    for _ in range(count):
        share = np.exp(rng.uniform(*np.log(fill))) if log_fill else rng.uniform(*fill)
        target = max(int(share * token_cap), min_doc)
        docs: list[int] = []
        while sum(docs) < target:
            n = int(np.exp(rng.uniform(lo, hi)))
            room = target - sum(docs)
            docs.append(max(min(n, room), min_doc))
        d = float(rng.uniform(d_lo, d_hi)) if d_hi > d_lo else d_hi
        if rng.uniform() < dense_share:
            d = 1.0
        out.append((docs, round(d, 3)))
    return out


# --------------------------------------------------------------------------- settings and grid


@dataclass
class ProfileSettings:
    lengths: list[int] | None = None
    densities: list[float] | None = None
    min_length: int = 128
    points_per_octave: float = 1.0
    token_points: int = 6
    warmup: int = 1
    repeats: int = 5
    packed_docs: int = 6
    seed: int = 0
    calibration_batches: int = 12  # random packed micro-batches that fit per-micro-batch/document overheads
    threads: int | None = None  # torch intra-op threads while timing (None: as configured)
    statistic: str = "median"  # or "min": less sensitive to load from other processes
    clock: str = "wall"  # or "cpu": process CPU time (CPU only; use with threads=1)
    attention_scope: str | None = None  # "document" | "micro_batch"; None: from the backend's name

    def length_grid(self, max_len: int, block_size: int) -> list[int]:
        if self.lengths:
            return sorted({int(n) for n in self.lengths})
        lo = min(max(self.min_length, 2 * block_size), max_len // 2)
        octaves = math.log2(max_len / lo)
        num = max(int(math.ceil(octaves * self.points_per_octave)) + 1, 2)
        return sorted({int(round(x)) for x in np.geomspace(lo, max_len, num)})

    def density_grid(self, supported: bool) -> list[float]:
        if not supported:
            return [1.0]
        return sorted({float(d) for d in (self.densities or [0.05, 0.15, 0.3, 0.5, 0.75, 0.95, 1.0])})

    def token_grid(self, token_cap: int, min_length: int) -> list[int]:
        lo = max(min(min_length, token_cap // 4), 16)
        return sorted({int(round(x)) for x in np.geomspace(lo, token_cap, max(self.token_points, 2))})


# --------------------------------------------------------------------------- profiling


class Workloads:
    """Builds the timed workloads of one model: a layer at (length, density), the whole model."""

    def __init__(self, model, driver: DensityDriver, dense_layers: list[int], mixed_precision: str = "no",
                 seed: int = 0, loss_mode: str = "auto"):
        register_noop_attention()
        self.model = model
        self.driver = driver
        self.config = model_config(model)
        self.layers = decoder_layers(model)
        n = len(self.layers)
        sparse = [i for i in range(n) if i not in set(int(d) % n for d in dense_layers)] or [0]
        self.layer_index = sparse[len(sparse) // 2]
        self.layer = self.layers[self.layer_index]
        self.device = next(model.parameters()).device
        self.dtype = next(p for p in model.parameters()).dtype
        self.mixed_precision = mixed_precision
        self.loss_mode = loss_mode
        self.vocab = int(getattr(self.config, "vocab_size", 1000))
        self.generator = torch.Generator().manual_seed(seed)
        self._inputs: dict[tuple, tuple[torch.Tensor, dict]] = {}
        self.attn_name = self.config._attn_implementation

    def layer_inputs(self, doc_lengths: tuple[int, ...]) -> tuple[torch.Tensor, dict]:
        key = tuple(doc_lengths)
        if key not in self._inputs:
            batch = packed_inputs(list(doc_lengths), self.vocab, self.device, self.generator)
            self.driver.force(1.0)
            with _autocast(self.device, self.mixed_precision):
                args, kwargs = capture_layer_inputs(self.model, self.layer, batch["input_ids"], batch["position_ids"])
            self.driver.drain()
            kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "past_key_value")}
            kwargs["use_cache"] = False
            hidden = args[0] if args else kwargs.pop("hidden_states")
            args = args[1:] if args else ()
            if args:
                raise ProfilingError("decoder layer takes positional arguments beyond hidden_states")
            self._inputs[key] = (hidden.detach(), kwargs)
        return self._inputs[key]

    def layer_run(self, doc_lengths: tuple[int, ...], density: float | None) -> Callable[[], None]:
        """Forward+backward of the measured layer; `density=None` means the no-op attention."""
        hidden0, kwargs = self.layer_inputs(doc_lengths)
        grad = torch.randn(hidden0.shape, generator=self.generator).to(hidden0.device, hidden0.dtype) * 1e-3

        def run() -> None:
            hidden = hidden0.clone().requires_grad_(True)
            ctx = attention_swapped(self.model, NOOP_ATTENTION) if density is None else contextlib.nullcontext()
            if density is not None:
                self.driver.force(density)
            with ctx:  # backward inside too: gradient checkpointing recomputes the forward there
                with _autocast(self.device, self.mixed_precision):
                    out = self.layer(hidden, **kwargs)
                    out = out[0] if isinstance(out, (tuple, list)) else out
                out.backward(grad)
            self.driver.drain()

        return run

    def model_run(self, doc_lengths: list[int], density: float | None) -> Callable[[], None]:
        """Forward+backward of the whole model on one packed micro-batch (the training loss)."""
        batch = packed_inputs(list(doc_lengths), self.vocab, self.device, self.generator)

        def run() -> None:
            ctx = attention_swapped(self.model, NOOP_ATTENTION) if density is None else contextlib.nullcontext()
            if density is not None:
                self.driver.force(density)
            with ctx:
                with _autocast(self.device, self.mixed_precision):
                    loss = model_loss(self.model, batch, self.loss_mode)
                (loss * 1e-3).backward()
            self.driver.drain()

        return run

    def optimizer_run(self, training_config: Any = None) -> Callable[[], None]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            return lambda: None
        from ..train.optim import build_optimizer

        optimizer = build_optimizer(training_config, params) if training_config is not None else None
        optimizer = optimizer or torch.optim.AdamW(params, lr=1e-6)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

        def run() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        return run

    def clear_grads(self) -> None:
        for p in self.model.parameters():
            p.grad = None


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _progress_bar(total: int, enabled: bool, label: str) -> Iterator[Callable[[str], None]]:
    """A rich bar on stderr, advanced once per measurement and naming the cell it measured."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[what]}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled) as bar:
        task = bar.add_task(label, total=total, what="")
        yield lambda what: bar.update(task, advance=1, what=what)


def profile_model(
    model,
    driver: DensityDriver,
    max_len: int,
    token_cap: int,
    block_size: int = 64,
    dense_layers: list[int] | None = None,
    settings: ProfileSettings | None = None,
    training_config: Any = None,
    mixed_precision: str = "no",
    meta: dict[str, Any] | None = None,
    progress: bool = True,
) -> ProfiledCostModel:
    """Profile a loaded (train-mode, LoRA-wrapped) model; returns the predictor (save it with `.save`)."""
    settings = settings or ProfileSettings()
    dense_layers = list(dense_layers or [])
    model.train()
    loss_mode = getattr(training_config, "loss", "auto")
    work = Workloads(model, driver, dense_layers, mixed_precision, settings.seed, loss_mode)
    scope = settings.attention_scope or ("micro_batch" if work.attn_name in MICRO_BATCH_SCOPED else "document")
    lengths = settings.length_grid(max_len, block_size)
    densities = settings.density_grid(driver.densities_supported)
    dense_column = bool(getattr(driver, "dense_path", False)) and driver.densities_supported
    if dense_column and 1.0 not in densities:
        densities = densities + [1.0]
    if dense_column and len(densities) < 3:
        raise ProfilingError("with a separate dense path, profile at least two densities below 1.0")
    tokens = settings.token_grid(token_cap, lengths[0])

    cells: list[Cell] = []
    for n in lengths:
        cells.append(Cell(("layer-noop", n), work.layer_run((n,), None)))
        for d in densities:
            cells.append(Cell(("layer", n, d), work.layer_run((n,), d)))
    k = max(int(settings.packed_docs), 2)
    short = lengths[0]
    d_mid = densities[len(densities) // 2]
    if scope == "document":  # attention's fixed cost per call vs per document, on the whole model
        for docs in ((short,), (short,) * k):
            cells.append(Cell(("overhead-noop", len(docs)), work.model_run(list(docs), None)))
            cells.append(Cell(("overhead", len(docs)), work.model_run(list(docs), d_mid)))
    for t in tokens:
        cells.append(Cell(("model-noop", t), work.model_run([t], None)))
    cells.append(Cell(("optimizer",), work.optimizer_run(training_config)))
    calibration = random_micro_batches(settings.calibration_batches, max_len, token_cap,
                                       [d for d in densities if d < 1.0] or densities, seed=settings.seed + 1000,
                                       fill=(0.05, 1.0), log_fill=True)
    for i, (docs, d) in enumerate(calibration):
        cells.append(Cell(("calibrate", i), work.model_run(docs, d)))

    total = len(cells) * (settings.warmup + settings.repeats)
    started = time.perf_counter()
    with _threads(settings.threads), _progress_bar(total, progress, "profile") as bar:
        measure_cells(cells, work.device, settings.warmup, settings.repeats, bar, settings.clock)
    driver.force(None)
    work.clear_grads()
    elapsed = time.perf_counter() - started

    by_key = {c.key: c.value(settings.statistic) for c in cells}
    noop = np.array([by_key[("layer-noop", n)] for n in lengths])
    real = np.array([[by_key[("layer", n, d)] for d in densities] for n in lengths])
    raw_attn = real - noop[:, None]
    call_overhead = 0.0
    if scope == "document":
        n_layers = len(work.layers)
        single = max(by_key[("overhead", 1)] - by_key[("overhead-noop", 1)], 0.0) / n_layers
        packed = max(by_key[("overhead", k)] - by_key[("overhead-noop", k)], 0.0) / n_layers
        per_doc = max((packed - single) / (k - 1), 0.0)
        call_overhead = float(np.clip(single - per_doc, 0.0, None))
    attn = np.maximum(raw_attn - call_overhead, 1e-7)
    dense_attn = None
    if dense_column:  # the exact-dense path is its own column, outside the density axis
        dense_attn = _isotonic(attn[:, -1], np.ones(len(lengths)))
        attn = attn[:, :-1]
        densities = densities[:-1]
    attn = np.vstack([_isotonic(row, np.ones_like(row)) for row in attn])  # monotone in density
    attn = np.vstack([_isotonic(col, np.ones_like(col)) for col in attn.T]).T  # and in length
    attn = _floor_quadratic(np.maximum(attn, 1e-7), lengths)
    if dense_attn is not None:
        dense_attn = _floor_quadratic(np.maximum(dense_attn, 1e-7)[:, None], lengths)[:, 0]
    linear_raw = np.array([by_key[("model-noop", t)] for t in tokens])
    linear = _isotonic(linear_raw, np.ones_like(linear_raw))
    model = ProfiledCostModel(
        lengths=np.array(lengths, dtype=np.float64), densities=np.array(densities), attn=attn,
        tokens=np.array(tokens, dtype=np.float64), linear=linear, num_layers=len(work.layers),
        dense_layers=dense_layers, attn_call_overhead=call_overhead, step_overhead=by_key[("optimizer",)],
        attention_scope=scope, dense_attn=dense_attn, extrapolate="allow",
    )
    fit = calibrate_overheads(model, [(docs, d, by_key[("calibrate", i)]) for i, (docs, d) in enumerate(calibration)])

    meta = dict(meta or {})
    meta.update({
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": {**current_hardware(), "torch_threads": settings.threads or torch.get_num_threads()},
        "versions": library_versions(),
        "model_config_hash": model_config_hash(work.config),
        "attn_implementation": work.attn_name,
        "measured_layer": work.layer_index,
        "dtype": str(work.dtype).replace("torch.", ""),
        "settings": asdict(settings),
        "profiling_seconds": round(elapsed, 2),
        "raw": {
            "layer_seconds": real.tolist(),
            "layer_noop_seconds": noop.tolist(),
            "model_noop_seconds": linear_raw.tolist(),
            "samples": {"|".join(map(str, c.key)): c.samples for c in cells},
        },
    })
    meta["calibration"] = fit
    spreads = [float((np.percentile(c.samples, 75) - np.percentile(c.samples, 25)) / max(np.median(c.samples), 1e-12))
               for c in cells if len(c.samples) >= 3]
    meta["noise"] = {"median_relative_iqr": float(np.median(spreads)) if spreads else None}
    model.meta = meta
    model.extrapolate = "warn"
    return model


def _floor_quadratic(table: np.ndarray, lengths: list[int]) -> np.ndarray:
    """Attention per document falls at most quadratically with length: lift noise-level entries at
    short lengths (where the attention is a small difference of two timings) to that bound."""
    out = table.copy()
    for i in range(len(lengths) - 2, -1, -1):
        out[i] = np.maximum(out[i], out[i + 1] * (lengths[i] / lengths[i + 1]) ** 2)
    return out


def profile_warnings(model: ProfiledCostModel) -> list[str]:
    """Signs that a profile's measurements were disturbed (e.g. by other processes on a shared CPU)."""
    out = []
    noise = (model.meta.get("noise") or {}).get("median_relative_iqr")
    if noise is not None and noise > 0.25:
        out.append(f"repeated timings varied by {noise:.0%} (median inter-quartile range): the machine was busy")
    fit = model.meta.get("calibration") or {}
    if fit.get("median_ape_after") is not None and fit["median_ape_after"] > 0.2:
        out.append(f"the profile misses its own calibration micro-batches by {fit['median_ape_after']:.0%} (median)")
    if out and model.meta.get("settings", {}).get("clock") == "wall" and model.meta.get("hardware", {}).get("device") == "cpu":
        out.append("on a shared CPU, profile with --threads 1 (the CPU clock then ignores time spent descheduled)")
    return out


def calibrate_overheads(model: ProfiledCostModel, measured: list[tuple[list[int], float, float]]) -> dict[str, Any]:
    """Fit `micro_batch_overhead` + `doc_overhead` x documents to what the tables miss on packed batches.

    Relative least squares (each batch weighted by 1/measured time); the per-document term is kept
    non-negative and the fixed term below the shortest measured batch. Sets them on `model`.
    """
    if len(measured) < 3:
        return {"batches": len(measured)}
    base = np.array([model.micro_batch_time(np.array(docs), d) for docs, d, _ in measured])
    y = np.array([t for _, _, t in measured])
    n = np.array([len(docs) for docs, _, _ in measured], dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-9)
    X = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    r = (y - base) * w
    (a, b), *_ = np.linalg.lstsq(X, r, rcond=None)
    if b < 0:
        b = 0.0
        a = float(np.sum(w * w * (y - base)) / np.sum(w * w))
    bound = 0.9 * float(y.min())
    a = float(np.clip(a, -bound, bound))
    model.micro_batch_overhead, model.doc_overhead = a, float(b)
    after = np.array([model.micro_batch_time(np.array(docs), d) for docs, d, _ in measured])
    ape = lambda p: float(np.median(np.abs(p - y) / y))  # noqa: E731
    return {"batches": len(measured), "micro_batch_overhead": a, "doc_overhead": float(b),
            "median_ape_before": ape(base), "median_ape_after": ape(after)}


def recipe_meta(recipe: Any, model: Any) -> dict[str, Any]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {
        "recipe_fingerprint": recipe.fingerprint(),
        "timing_key": timing_key(recipe),
        "model": {
            "path": recipe.model.path,
            "parameters": int(total),
            "trainable_parameters": int(trainable),
            "gradient_checkpointing": recipe.uses_gradient_checkpointing,
            "lora": recipe.lora.enabled,
        },
        "max_seq_len": recipe.data.max_seq_len,
        "token_cap": recipe.token_cap,
    }


def load_for_timing(recipe: Any):
    """`(model, driver)`: the recipe's model as it trains, with its density driver."""
    from ..train.model import load_model, resolve_mixed_precision

    model, _ = load_model(recipe)
    model.train()
    driver = attach_driver(model, recipe)
    return model, driver, resolve_mixed_precision(recipe.training.mixed_precision)


def profile_recipe(recipe: Any, settings: ProfileSettings | None = None, progress: bool = True) -> ProfiledCostModel:
    """Load the recipe's model and profile it (see module docstring)."""
    model, driver, mixed = load_for_timing(recipe)
    return profile_model(
        model, driver, max_len=recipe.data.max_seq_len, token_cap=recipe.token_cap,
        block_size=recipe.sparsity.block_size, dense_layers=list(recipe.sparsity.dense_layers),
        settings=settings, training_config=recipe.training, mixed_precision=mixed,
        meta=recipe_meta(recipe, model), progress=progress,
    )


__all__ = [
    "ProfileSettings", "profile_model", "profile_recipe", "Workloads", "DensityDriver", "DenseDriver",
    "ControllerDriver", "attach_driver", "attention_swapped", "register_noop_attention", "ProfilingError",
    "measure_cells", "Cell", "packed_inputs", "load_for_timing", "recipe_meta",
]
