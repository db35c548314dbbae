"""Batching policies: one step's window of documents -> (rank, micro-batch) assignment.

Every policy is a pure function of its inputs: the window (global document indices, already in
the epoch's shuffled order), their token lengths, optional per-document predicted times, the
world size and the micro-batch token cap. It returns `micro_batches[rank][m]`, lists of global
document indices, *before* padding (the sampler pads every rank to the same micro-batch count).

- `random`: the window split evenly in its shuffled order (the baseline plain sampler); each
  rank packs its documents in order (next-fit) under the cap.
- `tokens`: first-fit decreasing by token count onto ranks (sample-packing style token balance).
- `kk-length`: Karmarkar-Karp on length.
- `kk-flops`: Karmarkar-Karp on the quadratic FLOP proxy `a*L + L^2`.
- `length-grouped`: Karmarkar-Karp on the FLOP proxy, per step; across steps the sampler sorts the
  look-ahead by length first (the idea of transformers' `get_length_grouped_indices`).
- `verl`: Karmarkar-Karp into equal-count parts on verl's proxy `24576*L + L^2`; across steps the
  sampler first partitions the whole look-ahead into steps x ranks equal-count bins the same way.
- `sparsebalance`: Karmarkar-Karp on the cost model's predicted time per document (length and
  expected density), then a local search that moves or swaps documents off the slowest rank;
  across steps the sampler sorts the look-ahead by length bucket and predicted time per token.

The first four are one-step references (`random` is the plain shuffled sampler); the last three
are the policies that see the look-ahead window (`LOOKAHEAD_POLICIES`), and `length-grouped` and
`verl` are the fair peers every gain of `sparsebalance` is quoted against (`PEERS`).
Policies other than `random` pack each rank's documents with first-fit decreasing.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .kk import karmarkar_karp, karmarkar_karp_equal
from .packing import first_fit_decreasing, first_fit_ranks, next_fit

POLICIES = ("random", "tokens", "kk-length", "kk-flops", "length-grouped", "verl", "sparsebalance")
LOOKAHEAD_POLICIES = ("length-grouped", "verl", "sparsebalance")
PEERS = ("length-grouped", "verl")

# Default `a` of the FLOP proxy a*L + L^2: the ratio of per-token linear FLOPs to the per-token^2
# attention FLOPs of a dense Llama-8B-like model (6 * 8e9 / 9.2e5, about 52,000).
DEFAULT_FLOPS_A = 52_000.0
# `a` of verl's sequence-length balancing proxy a*L + L^2 (as verl describes it).
VERL_FLOPS_A = 24_576.0

RankParts = list[np.ndarray]  # per rank, positions into the window


def flops_proxy(lengths: np.ndarray, a: float = DEFAULT_FLOPS_A) -> np.ndarray:
    L = np.asarray(lengths, dtype=np.float64)
    return a * L + L * L


def _split_even(n: int, k: int) -> RankParts:
    return list(np.array_split(np.arange(n, dtype=np.int64), k))


def refine(parts: RankParts, weights: np.ndarray, max_rounds: int | None = None) -> RankParts:
    """Lower the heaviest part's load by moving one item to, or swapping one pair with, a light part.

    Each round takes the heaviest part and the lightest parts (up to 8) and applies the single
    move or swap that lowers the pair's larger load the most; it stops when nothing improves.
    Deterministic: ties go to the lowest part index and the earliest position.
    """
    k = len(parts)
    if k < 2:
        return parts
    w = np.asarray(weights, dtype=np.float64)
    parts = [np.asarray(p, dtype=np.int64) for p in parts]
    loads = np.array([w[p].sum() for p in parts])
    rounds = max_rounds if max_rounds is not None else 4 * k + 16
    eps = 1e-12 * max(float(loads.max()), 1e-300)
    for _ in range(rounds):
        h = int(np.argmax(loads))
        ph = parts[h]
        if ph.shape[0] == 0:
            break
        wh = w[ph]
        best = (0.0, -1, -1, -1)  # (gain, light part, pos in h, pos in light or -1 for a move)
        for l in np.argsort(loads, kind="stable")[:8].tolist():
            if l == h:
                continue
            gap = loads[h] - loads[l]
            if gap <= eps:
                break
            # move item i: new max = max(Lh - wi, Ll + wi); gain = Lh - new max
            gains = loads[h] - np.maximum(loads[h] - wh, loads[l] + wh)
            i = int(np.argmax(gains))
            if gains[i] > best[0] + eps:
                best = (float(gains[i]), l, i, -1)
            pl = parts[l]
            if pl.shape[0]:
                d = wh[:, None] - w[pl][None, :]  # swap i<->j moves d from h to l
                g = loads[h] - np.maximum(loads[h] - d, loads[l] + d)
                g[d <= 0] = 0.0
                flat = int(np.argmax(g))
                if g.flat[flat] > best[0] + eps:
                    i2, j2 = divmod(flat, pl.shape[0])
                    best = (float(g.flat[flat]), l, i2, j2)
        gain, l, i, j = best
        if l < 0:
            break
        if j < 0:
            item = ph[i]
            parts[h] = np.delete(ph, i)
            parts[l] = np.append(parts[l], item)
            loads[h] -= w[item]
            loads[l] += w[item]
        else:
            a_, b_ = ph[i], parts[l][j]
            parts[h] = ph.copy()
            parts[h][i] = b_
            parts[l] = parts[l].copy()
            parts[l][j] = a_
            loads[h] += w[b_] - w[a_]
            loads[l] += w[a_] - w[b_]
    return parts


def assign_ranks(
    policy: str,
    lengths: np.ndarray,
    world_size: int,
    costs: np.ndarray | None = None,
    flops_a: float = DEFAULT_FLOPS_A,
) -> RankParts:
    """Which window positions each rank gets (before micro-batch packing)."""
    n = int(lengths.shape[0])
    if policy == "random":
        return _split_even(n, world_size)
    if policy == "tokens":
        return first_fit_ranks(lengths, world_size)
    if policy == "kk-length":
        return karmarkar_karp(lengths, world_size)
    if policy in ("kk-flops", "length-grouped"):
        return karmarkar_karp(flops_proxy(lengths, flops_a), world_size)
    if policy == "verl":
        return karmarkar_karp_equal(flops_proxy(lengths, VERL_FLOPS_A), world_size)
    if policy == "sparsebalance":
        w = costs if costs is not None else flops_proxy(lengths, flops_a)
        return refine(karmarkar_karp(w, world_size), w)
    raise ValueError(f"unknown batching policy {policy!r}; choose one of {', '.join(POLICIES)}")


def plan_window(
    policy: str,
    docs: np.ndarray,
    lengths: np.ndarray,
    world_size: int,
    token_cap: int,
    costs: np.ndarray | None = None,
    flops_a: float = DEFAULT_FLOPS_A,
) -> list[list[list[int]]]:
    """Assign one window to (rank, micro-batch); returns unpadded `micro_batches[rank][m]`.

    `docs` are global document indices, `lengths` and `costs` are aligned with them.
    """
    docs = np.asarray(docs, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    parts = assign_ranks(policy, lengths, world_size, costs, flops_a)
    pack: Callable[[np.ndarray, int], list[list[int]]] = next_fit if policy == "random" else first_fit_decreasing
    out: list[list[list[int]]] = []
    for p in parts:
        p = np.asarray(p, dtype=np.int64)
        if policy != "random":
            p = np.sort(p)  # canonical order inside a rank: window order
        bins = pack(lengths[p], token_cap)
        gdocs = docs[p]
        out.append([[int(gdocs[i]) for i in b] for b in bins])
    return out
