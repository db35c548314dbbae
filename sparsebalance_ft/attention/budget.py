"""The budget API: what the balancer sets before a forward, and the report it reads after.

A budget ``b`` in [0, 1] maps monotonically onto the pair (threshold, ``k_max``), the threshold being the
selection rule's: the mass share ``tau`` (``selection: mass``) or the log-share margin (``selection: anchor``):

- ``b = config.budget`` (the default) gives exactly (``config.tau`` or ``config.anchor_margin``, ``config.k_max``);
- ``tau(b) = 1 - (1 - b)^p``, ``p`` chosen so that the default budget gives ``config.tau``: 0 (anchors only)
  at ``b = 0``, 1 at ``b = 1``. ``tau`` is a share of the mass the anchors leave, so on real attention the
  kept density rises smoothly with it (measured on SmolLM2-135M: `sbft bench real`, section `selection`);
- the margin shrinks linearly to 0 below the default and grows as ``anchor_margin / (1 - t)`` above it;
- ``k_max`` shrinks linearly to ``k_min`` below the default and grows as ``k_max / (1 - t)`` above it (t the
  position between the default and 1), reaching "no cap" at ``b = 1``, where every causal block is kept:
  dense attention exactly.

More budget never keeps fewer blocks: both rules keep a prefix of one budget-independent ranking, a larger
threshold lengthens the prefix and a larger cap only lifts a limit.
"""
from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from .config import SparsityConfig
from .register import CachedRoute, bind_controller, in_backward, register_sparse_attention
from .selection import Layout, Selection, scoring_dtype, select_block_sets

NO_CAP = 2**31 - 1  # k_max meaning "no cap"


def budget_params(config: SparsityConfig, budget: float) -> tuple[float, int]:
    """(threshold, k_max) that `budget` maps to. The threshold is `tau` for `selection: mass` and the margin
    for `selection: anchor` (math.inf at budget 1.0); k_max == NO_CAP means uncapped (budget 1.0)."""
    b = float(budget)
    if not 0.0 <= b <= 1.0 or math.isnan(b):
        raise ValueError(f"budget must be in [0, 1], got {budget!r}")
    anchor = config.selection == "anchor"
    b0, kmax0, kmin = config.budget, config.k_max, config.k_min
    if b >= 1.0:
        return (math.inf if anchor else 1.0), NO_CAP
    t = (b - b0) / (1.0 - b0) if b > b0 else 0.0  # position between the default and 1
    left = max(1e-9, 1.0 - t)
    if b <= b0 and b0 > 0.0:
        k_max = int(round(kmin + (kmax0 - kmin) * b / b0))
    else:
        k_max = int(min(NO_CAP, round(kmax0 / left)))
    if anchor:
        margin0 = config.anchor_margin
        return (margin0 * b / b0 if b <= b0 and b0 > 0.0 else margin0 / left), k_max
    tau = config.tau if b == b0 else 1.0 - (1.0 - b) ** _tau_exponent(config.tau, b0)
    return tau, k_max


def _tau_exponent(tau: float, default_budget: float) -> float:
    """``p`` with ``1 - (1 - default_budget)^p == tau``: the curve through (0, 0), (default, tau) and (1, 1)."""
    if tau >= 1.0:
        return math.inf
    if not 0.0 < default_budget < 1.0:
        return 1.0
    return math.log(1.0 - tau) / math.log(1.0 - default_budget)


def _anchor_counts(nb: int, sink: int, local: int) -> np.ndarray:
    i = np.arange(nb)
    s = np.minimum(sink, i + 1)
    lo = np.maximum(0, i - local + 1)
    overlap = np.maximum(0, s - lo)
    return s + (i - lo + 1) - overlap


def max_density(length: int, config: SparsityConfig, budget: float) -> float:
    """Density (kept / causal blocks) of a document of `length` tokens if every query block kept its cap
    max(k_max, anchors) (never more than its causal blocks): an upper bound for either selection rule, which
    share the floor and the cap."""
    _, k_max = budget_params(config, budget)
    nb = max(1, math.ceil(int(length) / config.block_size))
    causal = np.arange(1, nb + 1)
    if k_max >= nb:
        return 1.0
    cap = np.maximum(k_max, _anchor_counts(nb, config.sink_blocks, config.local_blocks))
    cap = np.maximum(cap, config.k_min)
    return float(np.minimum(cap, causal).sum() / causal.sum())


@dataclass
class AttentionReport:
    """What the attention did since the last `pop_report()`.

    layer_density[l]: kept / causal blocks over all forwards, heads and query blocks of layer l (None: not run;
    dense layers report 1.0). layer_recall[l]: sampled recall, the rows' (micro-batches') values weighted by their tokens (None when no
    samples were taken).
    doc_densities: one (document_length, density) per document per forward, density = kept / causal blocks
    summed over layers (dense layers included) and key-value heads, at the rank's budget: before layer-level
    DST moved a layer's selection, because this is what the density knowledge remembers a document by (its
    density at a budget). layer_density is what ran, moves included.
    """

    layer_density: list[float | None]
    layer_recall: list[float | None]
    doc_densities: list[tuple[int, float]]
    layer_budget: list[float]
    forwards: int = 0
    selection_seconds: float = 0.0
    forced_density: float | None = None

    @property
    def mean_density(self) -> float | None:
        vals = [d for d in self.layer_density if d is not None]
        return float(np.mean(vals)) if vals else None

    @property
    def mean_recall(self) -> float | None:
        vals = [r for r in self.layer_recall if r is not None]
        return float(np.mean(vals)) if vals else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["doc_densities"] = [list(x) for x in self.doc_densities]
        d["mean_density"] = self.mean_density
        d["mean_recall"] = self.mean_recall
        return d


@dataclass
class _Accum:
    kept: np.ndarray
    causal: np.ndarray
    recall_sum: np.ndarray
    recall_n: np.ndarray
    # (forward, row, layer, doc lengths, kept per doc, causal per doc, kept per doc at the rank's budget or
    # None when nothing moved the selection): the per-document counts stay tensors (on the attention's device) until pop_report, so recording a
    # layer costs no device-to-host copy
    pending: list = field(default_factory=list)
    # (layer, recall, tokens) whose recall is still a tensor on the attention's device, read at pop_report
    pending_recall: list = field(default_factory=list)
    forwards: int = 0
    last_layer: int | None = None
    selection_seconds: float = 0.0


class SparseAttentionController:
    """Per-model state of the `sparsebalance` attention: budgets in, reports out.

    It also remembers, per (layer, batch row), the route and the block selection of the last training
    forward: a gradient-checkpoint recompute (which runs inside the backward) reuses it instead of
    selecting again, so it computes exactly the blocks of the forward, is not counted in the report a
    second time and samples no recall. One training forward's selections are held (one per layer and
    row, replaced by the next forward), about ``Hkv * nq * K`` ints per layer.
    """

    def __init__(self, config: SparsityConfig | None = None, num_layers: int = 1):
        self.config = config or SparsityConfig()
        self.num_layers = int(num_layers)
        self._budgets = [float(self.config.budget)] * self.num_layers
        self._forced: float | None = None
        self._lock = threading.Lock()
        self._acc = self._new_acc()
        self._routes: dict[tuple[int, int], CachedRoute] = {}
        self.call_position_ids: torch.Tensor | None = None  # the model call's, for layers that do not pass them
        dense = set()
        for i in self.config.dense_layers:
            j = i + self.num_layers if i < 0 else i
            if not 0 <= j < self.num_layers:
                raise ValueError(f"sparsity.dense_layers: layer {i} out of range for {self.num_layers} layers")
            dense.add(j)
        self.dense_layers = frozenset(dense)

    # -- wiring ---------------------------------------------------------------------------------------
    @classmethod
    def attach(cls, model: torch.nn.Module, config: SparsityConfig | None = None) -> "SparseAttentionController":
        """Register the implementation, switch `model` (peft-wrapped or not) to it, and bind a controller."""
        register_sparse_attention()
        base = _base_model(model)
        hf_config = base.config
        _refuse_unsupported(hf_config)
        num_layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0) or _count_layers(base)
        controller = cls(config, num_layers)
        if getattr(hf_config, "_attn_implementation", None) != "sparsebalance":
            base.set_attn_implementation("sparsebalance")
        bound = bind_controller(base, controller)
        if bound == 0:
            raise ValueError("found no attention module with a `layer_idx` to attach the sparse attention to")
        return controller

    # -- the knob -------------------------------------------------------------------------------------
    def set_budget(self, budget: float | Sequence[float]) -> None:
        if isinstance(budget, (int, float)):
            values = [float(budget)] * self.num_layers
        else:
            values = [float(b) for b in budget]
            if len(values) != self.num_layers:
                raise ValueError(f"expected {self.num_layers} per-layer budgets, got {len(values)}")
        for b in values:
            if not 0.0 <= b <= 1.0 or math.isnan(b):
                raise ValueError(f"budget must be in [0, 1], got {b!r}")
        self._budgets = values

    @property
    def budgets(self) -> list[float]:
        return list(self._budgets)

    def budget_for(self, layer: int) -> float:
        return self._budgets[layer] if 0 <= layer < self.num_layers else float(self.config.budget)

    def select(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, budget: float, scale: float,
               window: int | None = None, force_density: float | None = None) -> Selection:
        """This config's block selection of one row (q: [Hq, padded, D], k: [Hkv, padded, D] in `layout`) at
        `budget`: the one call the attention, layer-level tuning and the bench probes share."""
        return self.select_at(q, k, layout, [budget], scale, window, force_density)[0]

    def select_at(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, budgets: list[float], scale: float,
                  window: int | None = None, force_density: float | None = None) -> list[Selection]:
        """`select` at each of `budgets`, from one scoring of the blocks (`select_block_sets`): layer-level
        tuning needs the rank's budget, MIN and MAX for every layer, and scoring is most of a selection."""
        cfg = self.config
        return select_block_sets(q, k, layout, cfg.selection, [budget_params(cfg, b) for b in budgets],
                                 k_min=cfg.k_min, sink_blocks=cfg.sink_blocks, local_blocks=cfg.local_blocks,
                                 scale=scale, window=window, force_density=force_density,
                                 score_queries=cfg.score_queries,
                                 score_dtype=scoring_dtype(cfg.score_precision, q.dtype, q.device),
                                 sampling_kernel=cfg.backend != "torch")

    def force_density(self, density: float | None) -> None:
        """Profiling mode: every query block keeps round(density * causal blocks) (>= 1); None switches it off."""
        if density is not None and not 0.0 <= float(density) <= 1.0:
            raise ValueError(f"forced density must be in [0, 1], got {density!r}")
        self._forced = None if density is None else float(density)

    @property
    def forced_density(self) -> float | None:
        return self._forced

    # -- checkpoint recompute -------------------------------------------------------------------------
    def keep_route(self, layer: int, row: int, route: CachedRoute) -> None:
        """Remember what a training forward's layer call did for `row` (replacing the previous forward's)."""
        self._routes[(layer, row)] = route

    def kept_route(self, layer: int, row: int, signature: tuple) -> CachedRoute | None:
        """The route the forward took for this (layer, row), if it was for the same layout."""
        route = self._routes.get((layer, row))
        return route if route is not None and route.signature == signature else None

    # -- reports --------------------------------------------------------------------------------------
    def _new_acc(self) -> _Accum:
        n = self.num_layers
        return _Accum(np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n))

    def record(self, layer: int, row: int, doc_lengths: list[int], doc_kept, doc_causal,
               recall: float | torch.Tensor | None, selection_seconds: float = 0.0,
               doc_kept_at_budget=None) -> None:
        """Account one layer call for one batch row: kept/causal blocks per document, summed over kv heads
        (arrays or tensors; tensors are read at `pop_report`); `doc_kept_at_budget`, when a layer tuner moved
        the selection, what was kept at the rank's budget before it (default: `doc_kept`). Calls made during a
        backward (a checkpoint recompute) are not new forwards and are ignored."""
        if in_backward():
            return
        with self._lock:
            acc = self._acc
            if row == 0 and (acc.last_layer is None or layer <= acc.last_layer):
                acc.forwards += 1
            if row == 0:
                acc.last_layer = layer
            if 0 <= layer < self.num_layers and recall is not None:
                tokens = max(1, sum(doc_lengths))  # weighted by the row's tokens: a 40-token micro-batch is not an 8K one
                if isinstance(recall, torch.Tensor):
                    acc.pending_recall.append((layer, recall, tokens))
                else:
                    acc.recall_sum[layer] += recall * tokens
                acc.recall_n[layer] += tokens
            acc.selection_seconds += selection_seconds
            acc.pending.append((acc.forwards, row, layer, list(doc_lengths), doc_kept, doc_causal,
                                doc_kept_at_budget))

    def pop_report(self) -> AttentionReport:
        with self._lock:
            acc, self._acc = self._acc, self._new_acc()
        # one device read for the whole step: every layer's recall and per-document counts
        recalls = [r for _, r, _ in acc.pending_recall]
        counts = [c for _, _, _, _, kept, causal, at_budget in acc.pending for c in (kept, causal, at_budget)
                  if c is not None]
        values = iter(_read_together(recalls + counts))
        for layer, _, tokens in acc.pending_recall:
            acc.recall_sum[layer] += next(values)[0] * tokens
        docs: dict[tuple[int, int, int], list] = {}
        for forward, row, layer, lengths, kept, causal, at_budget in acc.pending:
            kept, causal = next(values), next(values)
            at_budget = kept if at_budget is None else next(values)
            if 0 <= layer < self.num_layers:
                acc.kept[layer] += sum(kept)
                acc.causal[layer] += sum(causal)
            for d, (n, kk, cc) in enumerate(zip(lengths, at_budget, causal)):
                slot = docs.setdefault((forward, row, d), [n, 0.0, 0.0])
                slot[1] += kk
                slot[2] += cc
        dens = [float(k / c) if c > 0 else None for k, c in zip(acc.kept, acc.causal)]
        rec = [float(s / n) if n > 0 else None for s, n in zip(acc.recall_sum, acc.recall_n)]
        doc_dens = [(int(n), float(k / c) if c > 0 else 1.0) for (n, k, c) in docs.values()]
        return AttentionReport(dens, rec, doc_dens, self.budgets, acc.forwards, acc.selection_seconds, self._forced)


def _read_together(items: list) -> list[list[float]]:
    """Each item (a device tensor, an array or a number) as a list of floats, with one device read for all
    the tensors per device: a read per layer's counts was one host synchronisation each on a GPU."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for item in items:
        if isinstance(item, torch.Tensor):
            by_device.setdefault(item.device, []).append(item.detach().double().reshape(-1))
    flat = {device: iter(torch.cat(ts).cpu().tolist()) for device, ts in by_device.items()}
    return [[next(flat[item.device]) for _ in range(item.numel())] if isinstance(item, torch.Tensor)
            else np.asarray(item, dtype=np.float64).reshape(-1).tolist() for item in items]


def _refuse_unsupported(hf_config) -> None:
    """One line for model features the sparse attention cannot compute exactly (rather than a silent difference)."""
    configs = [hf_config, getattr(hf_config, "text_config", None)]
    for cfg in (c for c in configs if c is not None):
        cap = getattr(cfg, "attn_logit_softcapping", None)
        if cap is not None:
            raise ValueError(
                f"sparsebalance attention has no attention logit softcapping ({cfg.model_type}: attn_logit_softcapping"
                f"={cap}); use model.attn_implementation eager for this model")


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    if callable(get):
        try:
            return get()
        except Exception:  # pragma: no cover
            pass
    return model


def _count_layers(model: torch.nn.Module) -> int:
    idx = [getattr(m, "layer_idx", None) for m in model.modules()]
    idx = [i for i in idx if isinstance(i, int)]
    return max(idx) + 1 if idx else 1
