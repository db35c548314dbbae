"""The distributed batch sampler: a deterministic plan of (rank, micro-batch) per global step.

Every rank builds the same `BatchSampler` and asks it for `plan(epoch, step)`; the answer is a
pure function of (lengths, seed, epoch, step, policy, world size, cap) and of the predicted
document times `doc_cost` at that step, which the trainer builds from synced statistics, so
every rank gets the same plan without communicating.

Epoch order: a permutation of all documents drawn from `numpy.random.default_rng([seed, epoch])`.
Step `s` takes the window `order[s*W:(s+1)*W]` with `W = docs_per_rank * world_size` (the last
window may be shorter; nothing is dropped). The policies that see a look-ahead
(`LOOKAHEAD_POLICIES`: `length-grouped`, `verl`, `sparsebalance`) all get the same one: blocks of
`lookahead_steps` windows, each block regrouped into steps of comparable documents by
`lookahead.regroup_windows` (one implementation, the policy picks the key), the steps shuffled.
A block's step order is computed once, when its first step is planned, with the `doc_cost` of
that moment, and is cached and saved in `state_dict()` so a resumed run sees the same windows.
The one-step references (`random`, `tokens`, `kk-length`, `kk-flops`) always see one step.

Padding: every rank gets the same number of micro-batches (at least one); a rank with fewer
real micro-batches gets empty lists `[]` at the end. An empty micro-batch means "no forward
pass"; the trainer must still take part in the step's single gradient all-reduce (a rank whose
micro-batches are all empty contributes zero gradients).
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from .errors import BatchingError, DocumentTooLongError
from .lookahead import regroup_windows
from .policies import DEFAULT_FLOPS_A, LOOKAHEAD_POLICIES, POLICIES, flops_proxy, plan_window

DocCost = Callable[[np.ndarray], np.ndarray]
"""Predicted seconds (forward + backward) of each document, given global document indices."""

STATE_VERSION = 2
LOOKAHEAD_STEPS = 32  # default `balance.lookahead_steps`: windows the look-ahead policies regroup together


@dataclass(frozen=True)
class StepPlan:
    """One global step: `micro_batches[rank][m]` is a list of global document indices.

    All ranks have the same number of micro-batches; `[]` is an empty (padding) micro-batch.
    `predicted[rank]` is the sum of `doc_cost` over the rank's documents (None without doc_cost).
    """

    epoch: int
    step: int
    micro_batches: list[list[list[int]]]
    predicted: np.ndarray | None = field(default=None, compare=False)

    @property
    def world_size(self) -> int:
        return len(self.micro_batches)

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches[0])

    def docs(self, rank: int) -> list[int]:
        """All documents of one rank, in micro-batch order."""
        return [d for mb in self.micro_batches[rank] for d in mb]

    def all_docs(self) -> np.ndarray:
        return np.array([d for r in range(self.world_size) for d in self.docs(r)], dtype=np.int64)

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "micro_batches": self.micro_batches,
            "predicted": None if self.predicted is None else [float(x) for x in self.predicted],
        }


def _lengths_digest(lengths: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:16]


class BatchSampler:
    """Deterministic per-step assignment of documents to (rank, micro-batch).

    Args:
        lengths: token length of every document (1-D, each >= 1 and <= token_cap).
        world_size: number of data-parallel ranks.
        policy: one of `POLICIES` (the recipe's `balance.batching`).
        token_cap: most tokens one packed micro-batch may hold.
        docs_per_rank: documents per rank per step; a step's window is this x world_size.
        seed: the epoch order is drawn from (seed, epoch).
        doc_cost: predicted seconds per document, by global index; `sparsebalance` partitions by
            it (without it, by the FLOP proxy) and every plan reports per-rank predicted time.
            May be replaced between steps (`sampler.doc_cost = ...`).
        flops_a: `a` of the `kk-flops` / `length-grouped` proxy `a*L + L^2`.
        lookahead_steps: windows a look-ahead policy regroups together (1: none); the one-step
            references ignore it.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        world_size: int,
        policy: str = "random",
        token_cap: int = 4096,
        docs_per_rank: int = 4,
        seed: int = 0,
        doc_cost: DocCost | None = None,
        *,
        flops_a: float = DEFAULT_FLOPS_A,
        lookahead_steps: int = LOOKAHEAD_STEPS,
    ) -> None:
        if policy not in POLICIES:
            raise BatchingError(f"balance.batching: unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if int(world_size) < 1:
            raise BatchingError(f"world size must be >= 1, got {world_size}")
        if int(docs_per_rank) < 1:
            raise BatchingError(f"training.docs_per_rank must be >= 1, got {docs_per_rank}")
        if int(token_cap) < 1:
            raise BatchingError(f"token cap must be >= 1, got {token_cap}")
        if int(lookahead_steps) < 1:
            raise BatchingError(f"balance.lookahead_steps must be >= 1, got {lookahead_steps}")
        arr = np.asarray(lengths)
        if arr.ndim != 1:
            raise BatchingError(f"document lengths must be a flat list, got shape {arr.shape}")
        if arr.size == 0:
            raise BatchingError("no documents to batch: the dataset is empty")
        if not np.issubdtype(arr.dtype, np.integer):
            if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
                raise BatchingError("document lengths must be whole token counts")
        arr = arr.astype(np.int64)
        if np.any(arr < 1):
            i = int(np.flatnonzero(arr < 1)[0])
            raise BatchingError(f"document {i} has {int(arr[i])} tokens; every document needs at least one")
        over = np.flatnonzero(arr > int(token_cap))
        if over.size:
            i = int(over[np.argmax(arr[over])])
            more = f" ({over.size} documents are over it)" if over.size > 1 else ""
            raise DocumentTooLongError(
                f"document {i} has {int(arr[i])} tokens, more than the micro-batch token cap {int(token_cap)}"
                f"{more}; raise training.micro_batch_tokens or truncate/drop with data.max_seq_len and data.too_long"
            )
        self.lengths = arr
        self.lengths.setflags(write=False)
        self.world_size = int(world_size)
        self.policy = policy
        self.token_cap = int(token_cap)
        self.docs_per_rank = int(docs_per_rank)
        self.seed = int(seed)
        self.doc_cost = doc_cost
        self.flops_a = float(flops_a)
        self.lookahead_steps = int(lookahead_steps) if policy in LOOKAHEAD_POLICIES else 1
        self.epoch = 0
        self.step = 0  # the next step the iterator yields
        self._digest = _lengths_digest(arr)
        self._groups: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._order: tuple[int, np.ndarray] | None = None
        self._last_planned: tuple[int, int] | None = None
        self.last_plan: StepPlan | None = None  # the trainer syncs the step's per-document densities over it

    # ---- geometry -------------------------------------------------------------------------
    @property
    def num_docs(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def window(self) -> int:
        return self.docs_per_rank * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_docs / self.window)

    def __len__(self) -> int:
        return self.steps_per_epoch

    # ---- the plan -------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's shuffled order of all documents (read-only)."""
        if self._order is None or self._order[0] != int(epoch):
            order = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_docs)
            order.setflags(write=False)
            self._order = (int(epoch), order)
        return self._order[1]

    def _costs(self, docs: np.ndarray) -> np.ndarray | None:
        if self.doc_cost is None:
            return None
        c = np.asarray(self.doc_cost(docs), dtype=np.float64).reshape(-1)
        if c.shape[0] != docs.shape[0]:
            raise ValueError(f"doc_cost returned {c.shape[0]} values for {docs.shape[0]} documents")
        if not np.all(np.isfinite(c)) or np.any(c < 0):
            raise ValueError("doc_cost returned a negative or non-finite predicted time")
        return c

    def _group_windows(self, epoch: int, group: int) -> np.ndarray:
        """Documents of a look-ahead block, reordered so consecutive windows hold comparable documents."""
        key = (int(epoch), int(group))
        cached = self._groups.get(key)
        if cached is not None:
            self._groups.move_to_end(key)
            return cached
        order = self.epoch_order(epoch)
        span = self.window * self.lookahead_steps
        block = order[group * span : (group + 1) * span]
        windows = [block[w] for w in regroup_windows(self.policy, self.lengths[block], self._costs(block),
                                                      self.window, self.world_size)]
        perm = np.random.default_rng([self.seed, int(epoch), int(group), 1]).permutation(len(windows))
        shuffled = np.concatenate([windows[i] for i in perm])
        # window offsets (the one short window of an epoch may land anywhere in its block)
        starts = np.cumsum([0] + [windows[i].shape[0] for i in perm])
        packed = np.concatenate([starts.astype(np.int64), shuffled])  # [n_windows+1 offsets | docs]
        self._groups[key] = packed
        while len(self._groups) > 4:
            self._groups.popitem(last=False)
        return packed

    def window_docs(self, epoch: int, step: int) -> np.ndarray:
        """Global indices of the documents of one step, before assignment."""
        if not 0 <= int(step) < self.steps_per_epoch:
            raise ValueError(f"step {step} out of range: an epoch has {self.steps_per_epoch} steps")
        if self.lookahead_steps == 1:
            return self.epoch_order(epoch)[step * self.window : (step + 1) * self.window]
        group, local = divmod(int(step), self.lookahead_steps)
        packed = self._group_windows(epoch, group)
        n_windows = self._windows_in_group(group)
        starts = packed[: n_windows + 1]
        docs = packed[n_windows + 1 :]
        return docs[starts[local] : starts[local + 1]]

    def _windows_in_group(self, group: int) -> int:
        return min(self.lookahead_steps, self.steps_per_epoch - group * self.lookahead_steps)

    def plan(self, epoch: int, step: int) -> StepPlan:
        docs = self.window_docs(epoch, step)
        costs = self._costs(docs)
        mbs = plan_window(
            self.policy, docs, self.lengths[docs], self.world_size, self.token_cap,
            costs if self.policy == "sparsebalance" else None, self.flops_a,
        )
        m = max(1, max(len(r) for r in mbs))
        for r in mbs:
            r.extend([] for _ in range(m - len(r)))
        predicted = None
        if costs is not None:
            cost_of = dict(zip(docs.tolist(), costs.tolist()))
            predicted = np.array([sum(cost_of[d] for mb in r for d in mb) for r in mbs], dtype=np.float64)
        self._last_planned = (int(epoch), int(step))
        self.last_plan = StepPlan(int(epoch), int(step), mbs, predicted)
        return self.last_plan

    # ---- the training loop's view ---------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.step = int(epoch), 0

    def __iter__(self) -> Iterator[StepPlan]:
        """The rest of the current epoch, one plan per step; then the epoch advances.

        The position moves past a step as soon as its plan is yielded, so a `state_dict()`
        taken after that step finished resumes at the next one.
        """
        while self.step < self.steps_per_epoch:
            plan = self.plan(self.epoch, self.step)
            self.step += 1
            yield plan
        self.epoch, self.step = self.epoch + 1, 0

    # ---- resume -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "policy": self.policy,
            "world_size": self.world_size,
            "docs_per_rank": self.docs_per_rank,
            "token_cap": self.token_cap,
            "lookahead_steps": self.lookahead_steps,
            "num_docs": self.num_docs,
            "lengths_digest": self._digest,
            "group": None,
        }
        # The look-ahead block holding the next step to plan (after the last planned one; the
        # trainer may call plan() directly instead of iterating) was ordered with an earlier
        # doc_cost: keep it so a resumed run gets the same windows.
        nxt = (self.epoch, self.step)
        if self._last_planned is not None:
            e, s = self._last_planned
            nxt = (e, s + 1) if s + 1 < self.steps_per_epoch else (e + 1, 0)
        state["next"] = [int(nxt[0]), int(nxt[1])]
        if self.lookahead_steps > 1 and nxt[1] % self.lookahead_steps:
            group = nxt[1] // self.lookahead_steps
            packed = self._groups.get((nxt[0], group))
            if packed is not None:
                state["group"] = {"epoch": nxt[0], "index": group, "packed": packed.tolist()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise BatchingError(f"cannot resume the batch sampler: state version {state.get('version')!r} is not {STATE_VERSION}")
        mine = self.state_dict()
        for key in ("seed", "policy", "world_size", "docs_per_rank", "token_cap", "lookahead_steps", "num_docs", "lengths_digest"):
            if state.get(key) != mine[key]:
                raise BatchingError(
                    f"cannot resume the batch sampler: {key} was {state.get(key)!r} in the checkpoint and is {mine[key]!r} now"
                )
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        nxt = state.get("next")
        self._last_planned = (int(nxt[0]), int(nxt[1]) - 1) if nxt and int(nxt[1]) > 0 else None
        self._groups.clear()
        g = state.get("group")
        if g is not None:
            self._groups[(int(g["epoch"]), int(g["index"]))] = np.asarray(g["packed"], dtype=np.int64)


def doc_cost_from_stats(cost_model: Any, stats: Any, lengths: np.ndarray, budget: float) -> DocCost:
    """`doc_cost` as the trainer builds it: CostModel.doc_times at DensityStats.expected(L, budget)."""
    lens = np.asarray(lengths, dtype=np.int64)

    def doc_cost(idx: np.ndarray) -> np.ndarray:
        L = lens[idx]
        return np.asarray(cost_model.doc_times(L, stats.expected(L, budget)), dtype=np.float64)

    return doc_cost


def doc_cost_from_densities(cost_model: Any, lengths: np.ndarray, densities: np.ndarray) -> DocCost:
    """`doc_cost` from known per-document densities (e.g. observed in an earlier epoch)."""
    lens = np.asarray(lengths, dtype=np.int64)
    dens = np.asarray(densities, dtype=np.float64)

    def doc_cost(idx: np.ndarray) -> np.ndarray:
        return np.asarray(cost_model.doc_times(lens[idx], dens[idx]), dtype=np.float64)

    return doc_cost


def doc_cost_flops(lengths: np.ndarray, a: float = DEFAULT_FLOPS_A) -> DocCost:
    """A cost-model-free `doc_cost`: the FLOP proxy a*L + L^2 (arbitrary units)."""
    lens = np.asarray(lengths, dtype=np.int64)
    return lambda idx: flops_proxy(lens[idx], a)
