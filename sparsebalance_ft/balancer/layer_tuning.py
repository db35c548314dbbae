"""Layer-level DST: exact in-step balancing, one small exchange per layer.

The per-step tuner works on predictions; what a rank will really do is known only once a layer
has selected its blocks. Then, per (micro-batch, sparse layer), every rank:

1. computes its layer time now (`linear` + kept blocks x seconds per block), and the times it
   would have at MIN and at MAX budget (the same ranking's shorter and longer prefixes);
2. exchanges these three floats with ONE all_gather of a [3] tensor (cost measured, reported);
3. runs the same rule on the gathered [ranks, 3] array (`layer_target`, the recipe's
   `balance.target` read per layer): `mean`, the mean time of the ranks that can absorb work (MAX
   above MIN), raised to the slowest rank's time at MIN (no cut goes below it); `fastest`, that
   floor alone; `fill`, the slowest rank's time now (nobody is cut, the others fill up to it:
   the step's per-step decision is then the default budget, so this is the untuned layer's
   time); it moves its own selection toward the target (`move_toward`):
   a straggler drops its lowest-ranked blocks, a waiting rank adds its next-ranked ones, never
   past MIN / MAX and never below the anchors (the MIN selection keeps them).

Every rank decides its own move from the same gathered array with the same rule; nothing is
random. A rank with fewer real micro-batches calls `finish_step()` after its last one: it joins
the remaining exchanges with zero work (it absorbs nothing), so the collectives always match.

Gradient checkpointing: the recompute of a layer runs inside backward, where a collective could
deadlock or mismatch. `adjust` keeps each layer's final selection of the current forward and, in
backward, returns it unchanged without communicating. (attn-kernels' own recompute cache, when it
stores the selection after this hook, gives the same blocks; either way the recompute keeps
exactly what the first forward kept.)

Granularity: packed micro-batches have one row; a layer call is one exchange per row, so every
rank must run the same number of rows per forward (the trainer packs one row per micro-batch).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist


def layer_target(gathered: np.ndarray, rule: str = "mean") -> float:
    """T of one layer from every rank's [now, at MIN, at MAX] times (rows: ranks), by `balance.target`'s rule."""
    g = np.asarray(gathered, dtype=np.float64)
    now, lo, hi = g[:, 0], g[:, 1], g[:, 2]
    if rule == "fill":
        return float(now.max())
    if rule == "fastest":
        return float(lo.max())
    absorbs = hi > lo
    pool = absorbs if absorbs.any() else now > 0
    if not pool.any():
        return 0.0
    return float(max(now[pool].mean(), lo.max()))


def move_toward(target: float, now: float, lo: float, hi: float, tolerance: float = 0.0) -> float:
    """alpha in [-1, 1]: -1 is the MIN selection, 0 the current one, +1 the MAX one (time linear between)."""
    if now > target * (1.0 + tolerance) and now > lo:
        return -min(1.0, (now - target) / (now - lo))
    if now < target and hi > now:
        return min(1.0, (target - now) / (hi - now))
    return 0.0


def blend_counts(now: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per (head, query block) kept counts at `alpha`, totals exact: fractional moves are carried
    along the flattened order (error diffusion), so no block count is rounded away."""
    span = (now - lo) if alpha < 0 else (hi - now)
    move = alpha * span.double().flatten()
    whole = torch.floor(torch.cumsum(move, 0) + 0.5)
    step = torch.diff(whole, prepend=whole.new_zeros(1))
    out = now.flatten() + step.long()
    return torch.minimum(torch.maximum(out, lo.flatten()), hi.flatten()).view_as(now)


@dataclass
class LayerCost:
    """What one micro-batch's layer costs on this rank: fixed seconds plus seconds per kept block."""

    linear: float
    per_block: float


class LayerTuner:
    """Per-model state of layer-level DST on one rank (set as `controller.layer_tuner` by the trainer)."""

    def __init__(self, min_budget: float, max_budget: float, num_layers: int, dense_layers=(), group=None,
                 tolerance: float = 0.0, target: str = "mean"):
        if not 0.0 <= min_budget <= max_budget < 1.0:
            raise ValueError(f"layer tuning needs 0 <= min_budget <= max_budget < 1, got {min_budget}..{max_budget}")
        self.min_budget, self.max_budget = float(min_budget), float(max_budget)
        self.target = target
        self.hooked_layers = int(num_layers) - len(set(dense_layers))
        self.group = group
        self.tolerance = float(tolerance)
        self._costs: list[LayerCost] = []
        self._expected = self._done = 0
        self._cache: dict[int, object] = {}
        self.exchange_seconds = 0.0
        self.moved_blocks = 0.0
        self.kept_blocks = 0.0

    # -- step boundaries ------------------------------------------------------------------------
    def begin_step(self, costs: list[LayerCost], num_micro_batches: int) -> None:
        """Before a step: the real micro-batches' layer costs, and the step's micro-batch count (padding included)."""
        self._costs = list(costs)
        self._expected = int(num_micro_batches) * self.hooked_layers
        self._done = 0
        self._cache.clear()

    def finish_step(self) -> None:
        """After this rank's last real micro-batch: join the exchanges it has no work for."""
        while self._done < self._expected:
            self.join_exchange()

    def join_exchange(self) -> None:
        """Take part in one layer's exchange with no work (absorbing nothing): for a micro-batch this rank
        lacks, either after its last one (`finish_step`) or where the layer runs (a sharded model's padding
        forward, whose layers gather their weights between the exchanges: see train/sharding.py)."""
        self._exchange(np.zeros(3))

    def pop_stats(self) -> dict[str, float]:
        stats = {"layer_exchange_seconds": self.exchange_seconds, "layer_moved_share":
                 self.moved_blocks / self.kept_blocks if self.kept_blocks else 0.0}
        self.exchange_seconds = self.moved_blocks = self.kept_blocks = 0.0
        return stats

    # -- one layer ------------------------------------------------------------------------------
    def _exchange(self, row: np.ndarray) -> np.ndarray:
        self._done += 1
        started = time.perf_counter()
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1):
            out = row[None, :].copy()
        else:
            device = torch.device("cpu")
            if dist.get_backend(self.group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            local = torch.as_tensor(row, dtype=torch.float64, device=device)
            rows = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(rows, local, group=self.group)
            out = torch.stack(rows).cpu().numpy()
        self.exchange_seconds += time.perf_counter() - started
        return out

    def adjust(self, layer: int, sel, lo_sel, hi_sel, in_backward: bool = False):
        """The selection this layer runs with: `sel` (chosen at the rank's budget) moved toward the target.

        `lo_sel` and `hi_sel` are the same layer's selections at MIN and MAX budget, from the same ranking
        (`SparseAttentionController.select_at` scores once for all three). In backward (a gradient-checkpoint
        recompute) the first forward's result is returned as is.
        """
        if in_backward:
            return self._cache.get(layer, sel)
        micro_batch = self._done // max(self.hooked_layers, 1)
        cost = self._costs[micro_batch] if micro_batch < len(self._costs) else LayerCost(0.0, 0.0)
        c_now, c_lo, c_hi = sel.counts, torch.minimum(lo_sel.counts, sel.counts), torch.maximum(hi_sel.counts, sel.counts)
        times = np.array([cost.linear + cost.per_block * float(c.sum()) for c in (c_now, c_lo, c_hi)])
        gathered = self._exchange(times)
        alpha = move_toward(layer_target(gathered, self.target), *times.tolist(), tolerance=self.tolerance)
        out = sel
        if alpha != 0.0:
            counts = blend_counts(c_now, c_lo, c_hi, alpha)
            out = _prefix_selection(hi_sel, counts)
            self.moved_blocks += float((counts - c_now).abs().sum())
        self.kept_blocks += float(out.counts.sum())
        self._cache[layer] = out
        return out


def _prefix_selection(ranked, counts: torch.Tensor):
    """The first `counts` blocks of `ranked`'s per-query-block ranking (slots beyond padded with the diagonal)."""
    K = max(1, int(counts.max()))
    idx = ranked.indices[..., :K]
    if idx.shape[-1] < K:  # cannot happen: counts never exceed the MAX selection's
        raise RuntimeError("layer tuning asked for more blocks than the MAX selection ranks")
    nb = counts.shape[-1]
    diag = torch.arange(nb, device=idx.device)[None, :, None].expand_as(idx)
    slot = torch.arange(K, device=idx.device)
    idx = torch.where(slot[None, None, :] < counts[..., None], idx, diag).contiguous()
    return replace(ranked, indices=idx, counts=counts.contiguous(), full=False)
