"""`sbft bench step`: a whole LoRA training step, dense SDPA against the sparse attention, on a real model.

What a user sees is steps per second of a full optimizer step (forward, backward with gradient
checkpointing, loss, optimizer, data packing, the attention report), not the attention layer alone. This
bench runs that step through the trainer's own pieces (`train.model.load_model`, `data.pack_micro_batch`,
`train.step.run_local_step`, `train.optim.build_optimizer`, the accelerator of `train.loop`), built from a
recipe (`recipes/bench-step.yaml`: LoRA r16 on every linear layer, gradient checkpointing, the recipe's
loss and precision), and varies only the attention:

- `dense`: transformers' SDPA (flash / memory-efficient on a GPU);
- a budget (`0.3`, `0.5`, `0.7`, `1.0`): the `sparsebalance` attention at that budget (1.0 keeps every
  block and runs the exact dense route, so it must match `dense` in time and loss).

Per length, every arm steps once on a short warm-up, then the arms run interleaved, one step each per
repeat, in an order that reverses every repeat, so that drifting load from elsewhere hits every arm alike. Before each step the trainable weights
and the optimizer state are put back to where they started, so every arm's step sees the same weights and
the same tokens: the loss gap to dense is the attention's effect alone. `StepProbe` (bench/step_probe.py)
measures inside every timed step where the time goes (attention, selection, kernel forward and backward,
recomputation) and counts host synchronisations. The JSON is rewritten after every repeat, so a run
stopped early keeps what it measured. `--loss-only` (`run_loss_bench`) keeps the accuracy side alone: each
arm's loss from one forward, no timing.

Amdahl: with `a` the share of the dense step spent in attention and `d` the kept density, a sparse step can
be at most ``1 / (1 - a + a * d)`` times faster than dense (attention cost taken as proportional to the
kept blocks, everything else unchanged); `share_of_ceiling` is how much of that a row reached.
"""
from __future__ import annotations

import copy
import gc
import json
import math
import platform
import statistics
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..errors import UserError
from ..recipe import Recipe, load_recipe, recipe_from_dict
from .attention import PeakMemory
from .step_probe import StepProbe, counted_syncs, instrument_sparse_attention, timed_attention, timed_recompute

DEFAULT_LENGTHS = (4096, 8192, 16384, 32768)
ARMS = ("dense", "0.3", "0.5", "0.7", "1.0")
CPU_WARMUP_TOKENS = 2048  # a CPU warms up (thread pools, allocator) on a short step; CUDA on the full one
DENSE_TIMED = "sbft_bench_sdpa"
SPARSE_TIMED = "sbft_bench_sparsebalance"
BREAKDOWN = ("selection", "kernel_forward", "kernel_backward", "recompute", "report", "other")


class StepBenchError(UserError):
    """The step bench cannot run as asked (lengths, arms, repeats, data)."""


def amdahl_ceiling(attention_share: float, density: float) -> float:
    """Largest speedup of a step whose attention (share `attention_share` of it) keeps `density` of its work."""
    return 1.0 / (1.0 - attention_share + attention_share * density)


# ----------------------------------------------------------------------------- model and data


def bench_tokens(corpus, length: int) -> np.ndarray:
    """`length` tokens of real text as one document: the corpus's longest documents joined end to end
    (the longest alone, truncated, when it is long enough)."""
    order = np.argsort(-np.asarray(corpus.lengths), kind="stable")
    pieces, have = [], 0
    for index in order:
        pieces.append(np.asarray(corpus[int(index)]))
        have += len(pieces[-1])
        if have >= length:
            return np.concatenate(pieces)[:length]
    raise StepBenchError(f"the data holds {have:,} tokens, fewer than --lengths asks ({length:,})")


def native_positions(model_dir: Path | str) -> int:
    """The positions the checkpoint was trained for (0 when its config does not say)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 0)


def length_recipe(base: Recipe, length: int) -> Recipe:
    """The base recipe at one length: data.max_seq_len, and past the checkpoint's native positions a rope
    scaling at the factor that covers the length unless the recipe sets one. YaRN, the context-extension
    recipe's choice: untrained, it reads past the native length where linear interpolation does not
    (docs/context-extension.md), so the dense arm's loss there is a sane reference and `loss_gap` measures
    the attention rather than the damage the scaling does. The step's cost does not depend on the type."""
    data = base.model_dump(mode="json")
    data["data"]["max_seq_len"] = length
    native = native_positions(base.model.path)
    if native and length > native and data["model"].get("rope_scaling") is None:
        data["model"]["rope_scaling"] = {"type": "yarn", "factor": "auto"}
    return recipe_from_dict(data, "bench step recipe")


# ----------------------------------------------------------------------------- one length


@dataclass
class Sample:
    arm: str
    step_s: float
    loss: float
    kept_density: float
    recall: float | None
    peak_mem_bytes: int | None
    spans: dict[str, float]
    syncs: int
    attention_syncs: int


@dataclass
class LossSample:
    arm: str
    loss: float
    kept_density: float
    recall: float | None
    forward_s: float


def _kept_density(arm: str, report) -> float:
    """The kept share of causal blocks an arm's forward ran with: 1 for dense SDPA (it reports nothing)."""
    return 1.0 if arm == "dense" or report.mean_density is None else float(report.mean_density)


class LengthRun:
    """The recipe's model at one length, ready to step any arm from the same starting weights."""

    def __init__(self, recipe: Recipe, accelerator, probe: StepProbe):
        from accelerate.utils import set_seed

        from ..attention import SparseAttentionController
        from ..profiling.profiler import decoder_layers
        from ..train.model import check_model_dir, load_model
        from ..train.optim import build_optimizer

        check_model_dir(recipe)
        set_seed(recipe.training.seed)
        self.recipe, self.accelerator, self.probe = recipe, accelerator, probe
        model, _ = load_model(recipe)
        model.to(accelerator.device)
        model.train()
        self.model = model
        self.controller = SparseAttentionController.attach(model, recipe.sparsity)
        self.layers = decoder_layers(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = accelerator.prepare(build_optimizer(recipe.training, self.params))
        self._weights = [p.detach().clone() for p in self.params]
        self._optimizer_state = copy.deepcopy(self.optimizer.state_dict())

    def _reset(self) -> None:
        with torch.no_grad():
            for p, w in zip(self.params, self._weights):
                p.copy_(w)
        self.optimizer.load_state_dict(copy.deepcopy(self._optimizer_state))
        self.optimizer.zero_grad(set_to_none=True)

    def _use(self, arm: str) -> None:
        if arm == "dense":
            self.model.set_attn_implementation(DENSE_TIMED)
        else:
            self.model.set_attn_implementation(SPARSE_TIMED)
            self.controller.set_budget(float(arm))
        self.controller.pop_report()

    def step(self, arm: str, tokens: np.ndarray) -> Sample:
        """One optimizer step of `arm` on `tokens`, as `sbft train` runs it, from the starting weights."""
        from ..data import pack_micro_batch
        from ..train.step import run_local_step, synchronize

        self._reset()
        self._use(arm)
        device = self.accelerator.device
        targets = len(tokens) - 1  # one document: every token but the first is predicted
        gc.collect()
        synchronize(device)
        probe = self.probe
        with PeakMemory(device) as memory, timed_recompute(probe, self.layers), \
                instrument_sparse_attention(probe), counted_syncs(probe):
            probe.begin()
            start = time.perf_counter()
            batch = pack_micro_batch([tokens])
            local = run_local_step(self.accelerator, self.model, [batch], targets, self.params,
                                   self.recipe.training.loss)
            if self.recipe.training.max_grad_norm:
                self.accelerator.clip_grad_norm_(self.params, self.recipe.training.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            before_report = probe.mark()
            report = self.controller.pop_report()
            probe.span("report", before_report, probe.mark())
            synchronize(device)
            step_s = time.perf_counter() - start
        spans = probe.finish()
        return Sample(arm, step_s, local.loss_sum / max(local.target_tokens, 1),
                      _kept_density(arm, report), report.mean_recall, memory.peak_bytes, spans,
                      probe.syncs, probe.attention_syncs)

    def forward_loss(self, arm: str, tokens: np.ndarray) -> LossSample:
        """The loss `step` would report for `arm` on `tokens`, from the forward alone: no backward, no
        checkpoint recompute, no optimizer step, so the accuracy side of the bench reaches 32K in minutes."""
        from ..data import pack_micro_batch
        from ..train.loss import micro_batch_loss
        from ..train.step import synchronize

        self._use(arm)
        device = self.accelerator.device
        batch = {k: v.to(device) for k, v in pack_micro_batch([tokens]).items() if isinstance(v, torch.Tensor)}
        self.probe.begin()
        start = time.perf_counter()
        with torch.no_grad(), self.accelerator.autocast():
            loss_sum, count = micro_batch_loss(self.model, batch, self.recipe.training.loss)
        synchronize(device)
        forward_s = time.perf_counter() - start
        self.probe.finish()
        report = self.controller.pop_report()
        return LossSample(arm, float(loss_sum) / max(count, 1), _kept_density(arm, report), report.mean_recall,
                          forward_s)

    def close(self) -> None:
        """Release this length's model and optimizer (the accelerator holds the prepared optimizer: without
        `free_memory`, every earlier length's weights would stay allocated and count in the next peaks)."""
        self.model.set_attn_implementation("sdpa")
        del self.model, self.optimizer, self.params, self._weights
        self.accelerator.free_memory()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def register_timed_attentions(probe: StepProbe) -> None:
    """Dense SDPA and the sparse attention under the probe, as two attention implementations with the
    same mask functions as the originals."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    from ..attention.register import register_sparse_attention, sparsebalance_attention_forward, sparsebalance_mask

    register_sparse_attention()
    masks = AttentionMaskInterface._global_mapping
    AttentionInterface.register(DENSE_TIMED, timed_attention(probe, sdpa_attention_forward))
    AttentionMaskInterface.register(DENSE_TIMED, masks["sdpa"])
    AttentionInterface.register(SPARSE_TIMED, timed_attention(probe, sparsebalance_attention_forward))
    AttentionMaskInterface.register(SPARSE_TIMED, sparsebalance_mask)


# ----------------------------------------------------------------------------- rows


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def _attention_s(spans: dict[str, float]) -> float:
    return spans["attention_forward"] + spans["attention_recompute"] + spans["attention_backward"]


def cell_rows(length: int, samples: dict[str, list[Sample]], layers: int) -> list[dict[str, Any]]:
    """One row per arm of one length, from the repeats measured so far (medians)."""
    dense = samples.get("dense") or []
    dense_step = _median(s.step_s for s in dense)
    dense_attention = _median(_attention_s(s.spans) for s in dense)
    share = dense_attention / dense_step if dense and dense_step else None
    rows = []
    for arm, runs in samples.items():
        if not runs:
            continue
        step_s = _median(s.step_s for s in runs)
        density = _median(s.kept_density for s in runs)
        speedup = dense_step / step_s if dense_step else None
        ceiling = amdahl_ceiling(share, density) if share is not None else None
        gaps = [(s.loss - d.loss) / d.loss for s, d in zip(runs, dense)] if dense else []
        spans = {name: _median(s.spans[name] for s in runs) for name in runs[0].spans}
        attention = _median(_attention_s(s.spans) for s in runs)
        breakdown = None
        if arm != "dense":
            measured = {name: spans[name] for name in BREAKDOWN[:-1]}
            breakdown = {**measured, "other": step_s - sum(measured.values())}
        rows.append({
            "length": length,
            "arm": arm,
            "budget": None if arm == "dense" else float(arm),
            "repeats": len(runs),
            "step_s": step_s,
            "step_s_all": [s.step_s for s in runs],
            "tokens_per_s": length / step_s,
            "speedup_vs_dense": speedup,
            "loss": _median(s.loss for s in runs),
            "loss_gap": _median(gaps),
            "kept_density": density,
            "recall": _median(s.recall for s in runs),
            "peak_mem_bytes": max((s.peak_mem_bytes for s in runs if s.peak_mem_bytes is not None), default=None),
            "attention_share": share,
            "amdahl_ceiling": ceiling,
            "share_of_ceiling": speedup / ceiling if speedup is not None and ceiling else None,
            "attention_s": attention,
            "attention_speedup": dense_attention / attention if dense_attention and attention else None,
            "attention_ideal": 1.0 / density if density else None,
            "selection_share_of_attention": spans["selection"] / attention if arm != "dense" and attention else None,
            "report_share_of_step": spans["report"] / step_s,
            "spans": spans,
            "breakdown": breakdown,
            "host_syncs_per_step": _median(s.syncs for s in runs),
            "attention_host_syncs_per_step": _median(s.attention_syncs for s in runs),
            "attention_host_syncs_per_layer": (_median(s.attention_syncs for s in runs) or 0.0) / layers,
        })
    return rows


# ----------------------------------------------------------------------------- the bench


@dataclass
class StepPlan:
    lengths: list[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    repeats: list[int] = field(default_factory=lambda: [3] * len(DEFAULT_LENGTHS))
    device: str = "cpu"
    backend: str = "auto"
    dtype: str = "auto"

    def check(self) -> None:
        if not self.lengths or any(n < 64 for n in self.lengths):
            raise StepBenchError("--lengths: give one or more lengths of at least 64 tokens")
        if len(self.repeats) == 1:
            self.repeats = self.repeats * len(self.lengths)
        if len(self.repeats) != len(self.lengths) or min(self.repeats) < 1:
            raise StepBenchError(f"--repeats: one count (>= 1), or one per length ({len(self.lengths)})")
        unknown = [a for a in self.arms if a != "dense" and not _is_budget(a)]
        if unknown or "dense" not in self.arms:
            raise StepBenchError(f"--arms: dense and budgets in [0, 1] (e.g. {','.join(ARMS)}); got {','.join(self.arms)}")
        if self.device not in ("cpu", "cuda"):
            raise StepBenchError(f"--device: cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise StepBenchError("--device cuda: no CUDA device here")
        if self.backend not in ("auto", "torch", "flex", "triton"):
            raise StepBenchError(f"--backend: auto, torch, flex or triton, got {self.backend!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise StepBenchError(f"--dtype: auto, float32, bfloat16 or float16, got {self.dtype!r}")


def _is_budget(text: str) -> bool:
    try:
        return 0.0 <= float(text) <= 1.0
    except ValueError:
        return False


def bench_recipe(recipe_path: Path, model_dir: Path, plan: StepPlan, overrides: list[str]) -> Recipe:
    """The bench recipe with the command line's model, device precision and backend (then the user's --set)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    cpu = plan.device == "cpu"
    dtype = "float32" if cpu and plan.dtype == "auto" else plan.dtype  # auto would pick bf16 on a GPU machine
    precision = '"no"' if cpu else "auto"  # quoted: YAML reads a bare no as false
    forced = [f"model.path={model_dir}", f"data.path={stdlib}", f"sparsity.backend={plan.backend}",
              f"model.dtype={dtype}", f"training.mixed_precision={precision}"]
    return load_recipe(recipe_path, forced + list(overrides))


class _BenchSetup:
    """What every length of a run shares: the recipe as given, the data read once up to the longest length,
    the accelerator, the probe and the result's header."""

    def __init__(self, recipe_path: Path, model_dir: Path, plan: StepPlan, overrides: list[str]):
        from ..data import load_corpus
        from ..train.loop import make_accelerator
        from ..train.model import load_tokenizer

        self.recipe = bench_recipe(recipe_path, model_dir, plan, overrides)
        longest = length_recipe(self.recipe, max(plan.lengths))
        self.corpus = load_corpus(longest.data, load_tokenizer(longest), progress=False)
        self.accelerator = make_accelerator(longest, cpu=plan.device == "cpu")
        self.probe = StepProbe(self.accelerator.device)
        register_timed_attentions(self.probe)
        self.result = _result_header(longest, plan, torch.device(plan.device))

    def length_run(self, length: int) -> tuple[LengthRun, np.ndarray]:
        """The model at `length`, with the rope scaling of that length alone (a shorter length within the
        native positions runs unscaled, whatever the longest needs), and its tokens. Records the length's
        model and scaling in the result's `lengths`."""
        recipe = length_recipe(self.recipe, length)
        scaling = recipe.model.rope_scaling
        self.result["lengths"][str(length)] = {"model_path": recipe.model.path,
                                               "rope_scaling": scaling.model_dump(mode="json") if scaling else None}
        return LengthRun(recipe, self.accelerator, self.probe), bench_tokens(self.corpus, length)


def run_step_bench(recipe_path: Path, model_dir: Path, plan: StepPlan, out: Path,
                   overrides: list[str] | None = None, say: Callable[[str], None] = lambda line: None) -> dict:
    """Every arm at every length (see the module docstring); writes `out` (JSON) after each repeat and the
    PNG beside it at the end. Returns the result."""
    plan.check()
    setup = _BenchSetup(recipe_path, model_dir, plan, overrides or [])
    device, result = torch.device(plan.device), setup.result
    out.parent.mkdir(parents=True, exist_ok=True)
    for length, repeats in zip(plan.lengths, plan.repeats):
        run, tokens = setup.length_run(length)
        layers = len(run.layers)
        result["lengths"][str(length)].update(
            repeats=repeats, warmup_tokens=length if device.type == "cuda" else min(length, CPU_WARMUP_TOKENS))
        warm = tokens[:result["lengths"][str(length)]["warmup_tokens"]]
        for arm in plan.arms:
            run.step(arm, warm)
        say(f"L={length}: warmed up; {repeats} repeat(s) of {len(plan.arms)} arms")
        samples: dict[str, list[Sample]] = {arm: [] for arm in plan.arms}
        for r in range(repeats):
            # the order reverses every repeat (A B C, C B A, ...): a load that drifts over the run hits every arm alike
            for arm in plan.arms if r % 2 == 0 else plan.arms[::-1]:
                sample = run.step(arm, tokens)
                samples[arm].append(sample)
                say(f"  L={length} repeat {r + 1}/{repeats} {arm:>5}: {sample.step_s:.2f}s loss {sample.loss:.4f} "
                    f"density {sample.kept_density:.3f}")
            result["rows"] = [row for row in result["rows"] if row["length"] != length] + cell_rows(length, samples, layers)
            _write(result, out)
        run.close()
    result["complete"] = True
    _write(result, out)
    from .step_report import save_step_png

    save_step_png(result, out.with_suffix(".png"))
    return result


def loss_rows(length: int, samples: list[LossSample]) -> list[dict[str, Any]]:
    """One row per arm of one length: loss, gap to dense on the same tokens, kept density, recall."""
    dense = next((s.loss for s in samples if s.arm == "dense"), None)
    return [{"length": length, "arm": s.arm, "budget": None if s.arm == "dense" else float(s.arm),
             "loss": s.loss, "loss_gap": (s.loss - dense) / dense if dense else None,
             "kept_density": s.kept_density, "recall": s.recall, "forward_s": s.forward_s} for s in samples]


def run_loss_bench(recipe_path: Path, model_dir: Path, plan: StepPlan, out: Path,
                   overrides: list[str] | None = None, say: Callable[[str], None] = lambda line: None) -> dict:
    """`--loss-only`: every arm's loss on the step's tokens at every length, one forward each (the loss is
    deterministic, so no repeats), with the same recipe, weights and rope scaling as `run_step_bench`.
    Writes `out` after each arm."""
    plan.check()
    setup = _BenchSetup(recipe_path, model_dir, plan, overrides or [])
    result = setup.result
    result["setup"]["step"] = ("pack_micro_batch + the trainer's micro_batch_loss under no_grad (forward only), "
                               "from the same starting weights for every arm")
    result["notes"] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    for length in plan.lengths:
        run, tokens = setup.length_run(length)
        samples = []
        for arm in plan.arms:
            sample = run.forward_loss(arm, tokens)
            samples.append(sample)
            say(f"  L={length} {arm:>5}: loss {sample.loss:.4f} density {sample.kept_density:.3f} "
                f"({sample.forward_s:.1f}s)")
            result["rows"] = [row for row in result["rows"] if row["length"] != length] + loss_rows(length, samples)
            _write(result, out)
        run.close()
    result["complete"] = True
    _write(result, out)
    return result


def _result_header(recipe: Recipe, plan: StepPlan, device: torch.device) -> dict:
    notes = []
    if min(plan.repeats) < 3:
        short = [n for n, r in zip(plan.lengths, plan.repeats) if r < 3]
        notes.append(f"fewer than 3 repeats at {', '.join(map(str, short))} tokens (each a median of what ran)")
    memory = ("torch.cuda.max_memory_allocated during the step" if device.type == "cuda" else
              "peak resident set size during the step, sampled every 5 ms (glibc keeps some freed memory "
              "resident: an upper bound on the tensors' peak)")
    return {
        "setup": {
            "recipe": recipe.model_dump(mode="json"),
            "lengths": plan.lengths, "arms": plan.arms, "repeats": plan.repeats,
            "device": plan.device, "backend": plan.backend, "dtype": plan.dtype,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "step": "pack_micro_batch + run_local_step (forward, loss, backward with gradient checkpointing) "
                    "+ clip + optimizer step + attention report, from the same starting weights for every arm",
            "data": "the first tokens of data.path's longest document (documents truncated at the longest length, "
                    "ties in file order), more documents joined when it is shorter than the length",
            "peak_mem": memory,
            "host_syncs": ("see counted_syncs in sparsebalance_ft/bench/step_probe.py: CUDA sync debug mode on "
                           "a GPU, Python-level tensor value reads on CPU"),
            "attention_share": "attention calls' time (forward, checkpoint recompute, backward) in the dense step "
                               "over the dense step's time",
        },
        "notes": notes,
        "lengths": {},
        "rows": [],
        "complete": False,
    }


def _write(result: dict, out: Path) -> None:
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)
