"""The batch sampler's contract on adversarial inputs: exactly once, cap, equal micro-batch counts,
determinism across processes, resume mid-epoch."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from sparsebalance_ft.batching import (
    LOOKAHEAD_POLICIES,
    PEERS,
    POLICIES,
    BatchingError,
    BatchSampler,
    DocumentTooLongError,
    StepPlan,
    doc_cost_flops,
    doc_cost_from_densities,
)
from sparsebalance_ft.cost.model import AnalyticCostModel
from sparsebalance_ft.errors import UserError

CAP = 4096


def check_plan(plan: StepPlan, lengths: np.ndarray, world_size: int, cap: int) -> None:
    assert plan.world_size == world_size
    counts = {len(rank) for rank in plan.micro_batches}
    assert len(counts) == 1 and plan.num_micro_batches >= 1, counts  # same count on every rank
    for rank in plan.micro_batches:
        for mb in rank:
            assert isinstance(mb, list)
            assert all(isinstance(d, int) for d in mb)
            assert int(lengths[mb].sum()) <= cap if mb else True
        # padding only at the end
        seen_empty = False
        for mb in rank:
            if not mb:
                seen_empty = True
            else:
                assert not seen_empty, "empty micro-batches must come after the real ones"


def check_epoch(sampler: BatchSampler, epoch: int = 0) -> list[StepPlan]:
    plans = [sampler.plan(epoch, s) for s in range(sampler.steps_per_epoch)]
    for p in plans:
        check_plan(p, sampler.lengths, sampler.world_size, sampler.token_cap)
    used = np.concatenate([p.all_docs() for p in plans])
    assert np.array_equal(np.sort(used), np.arange(sampler.num_docs)), "every document exactly once per epoch"
    for s, p in enumerate(plans):
        assert p.all_docs().size <= sampler.window
        assert set(p.all_docs().tolist()) == set(sampler.window_docs(epoch, s).tolist())
    return plans


def datasets():
    rng = np.random.default_rng(0)
    heavy = np.minimum(rng.lognormal(6.5, 1.3, 300).astype(np.int64) + 1, CAP)
    one_huge = np.full(50, 10, dtype=np.int64)
    one_huge[17] = CAP
    return {
        "heavy-tail": heavy,
        "one-huge": one_huge,
        "all-equal": np.full(64, 500, dtype=np.int64),
        "all-at-cap": np.full(20, CAP, dtype=np.int64),
        "fewer-docs-than-ranks": np.array([100, 3000, 7], dtype=np.int64),
        "single-doc": np.array([CAP], dtype=np.int64),
        "ragged-last-window": np.arange(1, 38, dtype=np.int64) * 100,
    }


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(datasets()))
@pytest.mark.parametrize("world_size", [1, 4, 8])
def test_constraints(policy, name, world_size):
    L = datasets()[name]
    s = BatchSampler(L, world_size, policy, CAP, docs_per_rank=3, seed=5, doc_cost=doc_cost_flops(L), lookahead_steps=4)
    plans = check_epoch(s)
    assert len(plans) == -(-L.size // (3 * world_size))
    again = [s.plan(0, i) for i in range(s.steps_per_epoch)]
    assert [p.micro_batches for p in plans] == [p.micro_batches for p in again]


def test_fewer_docs_than_ranks_pads_with_empty_micro_batches():
    L = np.array([100, 3000, 7], dtype=np.int64)
    plan = BatchSampler(L, 8, "sparsebalance", CAP, 4, doc_cost=doc_cost_flops(L)).plan(0, 0)
    assert plan.num_micro_batches == 1
    assert sum(1 for r in plan.micro_batches if r == [[]]) == 5
    assert plan.predicted is not None and plan.predicted.shape == (8,)
    assert np.count_nonzero(plan.predicted) == 3


def test_one_huge_document_gets_a_rank_of_its_own():
    L = np.full(32, 10, dtype=np.int64)
    L[3] = CAP
    for policy in ("kk-length", "kk-flops", "sparsebalance"):
        plan = BatchSampler(L, 4, policy, CAP, 8, doc_cost=doc_cost_flops(L)).plan(0, 0)
        owner = [r for r in range(4) if 3 in plan.docs(r)][0]
        assert plan.docs(owner) == [3], policy


def test_document_over_cap_is_a_one_line_user_error():
    L = np.array([10, 5000, 20, 9000], dtype=np.int64)
    with pytest.raises(DocumentTooLongError) as info:
        BatchSampler(L, 2, "sparsebalance", CAP)
    assert isinstance(info.value, UserError)
    msg = str(info.value)
    assert "\n" not in msg and "document 3" in msg and "9000" in msg and str(CAP) in msg


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"policy": "greedy"}, "unknown policy"),
        ({"world_size": 0}, "world size"),
        ({"docs_per_rank": 0}, "docs_per_rank"),
        ({"lengths": np.array([], dtype=np.int64)}, "empty"),
        ({"lengths": np.array([5, 0, 3])}, "document 1"),
        ({"lengths": np.array([5.5, 3])}, "whole"),
    ],
)
def test_bad_settings_are_user_errors(kwargs, fragment):
    args = {"lengths": np.array([5, 6, 7]), "world_size": 2, "policy": "random", "token_cap": CAP, "docs_per_rank": 2}
    args.update(kwargs)
    with pytest.raises(BatchingError, match=fragment):
        BatchSampler(**args)


def test_epochs_differ_and_seed_matters():
    L = np.arange(1, 201, dtype=np.int64)
    a = BatchSampler(L, 4, "kk-length", CAP, 4, seed=1)
    b = BatchSampler(L, 4, "kk-length", CAP, 4, seed=2)
    assert a.plan(0, 0).micro_batches != a.plan(1, 0).micro_batches
    assert a.plan(0, 0).micro_batches != b.plan(0, 0).micro_batches


def test_sparsebalance_leads_the_fair_peers_when_density_varies_by_document():
    """Per-document density the FLOP proxies cannot see: with the same look-ahead, the cost-aware
    partition must balance predicted cost at least as well as the best peer, and the peers (with
    look-ahead) better than the one-step references."""
    rng = np.random.default_rng(3)
    L = np.minimum(rng.lognormal(6.5, 1.3, 2000).astype(np.int64) + 1, CAP)
    dens = rng.lognormal(np.log(0.3), 0.5, L.size).clip(0.02, 1.0)
    cost = doc_cost_from_densities(AnalyticCostModel.llama_8b(), L, dens)

    def epoch_imbalance(policy):
        s = BatchSampler(L, 8, policy, CAP, 4, doc_cost=cost, lookahead_steps=32)
        mx = mn = 0.0
        for p in s:
            mx += p.predicted.max()
            mn += p.predicted.mean()
        return mx / mn

    imb = {p: epoch_imbalance(p) for p in POLICIES}
    assert imb["sparsebalance"] <= min(imb[p] for p in PEERS)
    assert max(imb[p] for p in PEERS) < imb["kk-flops"] < imb["random"]


def test_every_lookahead_policy_sees_the_same_window():
    rng = np.random.default_rng(8)
    L = np.minimum(rng.lognormal(7, 1.2, 300).astype(np.int64) + 1, CAP)
    cost = doc_cost_flops(L)
    blocks = {}
    for policy in LOOKAHEAD_POLICIES:
        s = BatchSampler(L, 4, policy, CAP, 2, seed=1, doc_cost=cost, lookahead_steps=6)
        blocks[policy] = sorted(d for k in range(6) for d in s.window_docs(0, k).tolist())
    assert blocks["length-grouped"] == blocks["verl"] == blocks["sparsebalance"]
    first_six = sorted(BatchSampler(L, 4, "random", CAP, 2, seed=1).epoch_order(0)[:48].tolist())
    assert blocks["sparsebalance"] == first_six


def test_lookahead_one_is_no_regrouping():
    rng = np.random.default_rng(2)
    L = np.minimum(rng.lognormal(7, 1.2, 200).astype(np.int64) + 1, CAP)
    grouped = BatchSampler(L, 4, "length-grouped", CAP, 4, seed=3, lookahead_steps=1)
    plain = BatchSampler(L, 4, "kk-flops", CAP, 4, seed=3)
    for k in range(grouped.steps_per_epoch):
        assert grouped.plan(0, k).micro_batches == plain.plan(0, k).micro_batches


def test_length_grouped_steps_hold_comparable_lengths():
    rng = np.random.default_rng(4)
    L = np.minimum(rng.lognormal(7, 1.2, 512).astype(np.int64) + 1, CAP)
    s = BatchSampler(L, 4, "length-grouped", CAP, 4, seed=0, lookahead_steps=32)
    spans = [np.ptp(L[s.window_docs(0, k)]) for k in range(s.steps_per_epoch)]
    plain = BatchSampler(L, 4, "kk-flops", CAP, 4, seed=0)
    plain_spans = [np.ptp(L[plain.window_docs(0, k)]) for k in range(plain.steps_per_epoch)]
    assert np.mean(spans) < 0.25 * np.mean(plain_spans)


def test_verl_gives_every_rank_the_same_document_count():
    L = np.random.default_rng(6).integers(10, CAP, 256)
    s = BatchSampler(L, 8, "verl", CAP, 4, seed=0, lookahead_steps=8)
    for k in range(s.steps_per_epoch):
        counts = [len(s.plan(0, k).docs(r)) for r in range(8)]
        assert max(counts) - min(counts) <= 1 and sum(counts) == 32


# ---- determinism across processes -------------------------------------------------------------

_CHILD = r"""
import json, sys
import numpy as np
from sparsebalance_ft.batching import BatchSampler, doc_cost_from_densities, POLICIES
from sparsebalance_ft.cost.model import AnalyticCostModel
rng = np.random.default_rng(11)
L = np.minimum(rng.lognormal(7.5, 1.2, 700).astype(np.int64) + 1, 16384)
dens = rng.uniform(0.05, 0.9, L.size)
cost = doc_cost_from_densities(AnalyticCostModel.llama_8b(), L, dens)
out = {}
for policy in POLICIES:
    s = BatchSampler(L, 8, policy, 16384, 4, seed=123, doc_cost=cost, lookahead_steps=5)
    out[policy] = [s.plan(e, k).micro_batches for e in (0, 1) for k in range(s.steps_per_epoch)]
json.dump(out, sys.stdout)
"""


def test_same_plans_in_two_processes():
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
        for seed in (1, 2)
    ]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout))
    assert outs[0] == outs[1]
    assert set(outs[0]) == set(POLICIES)


# ---- resume mid-epoch ------------------------------------------------------------------------


class DriftingCost:
    """A doc_cost that changes after every step, like statistics that improve during training."""

    def __init__(self, lengths):
        self.lengths = lengths
        self.version = 0

    def __call__(self, idx):
        L = self.lengths[idx].astype(float)
        density = 0.2 + 0.05 * ((self.version + idx) % 7)
        return 1e-4 * L + 1e-8 * density * L * L


@pytest.mark.parametrize("policy", POLICIES)
def test_resume_mid_epoch_gives_the_same_plans(policy):
    rng = np.random.default_rng(4)
    L = np.minimum(rng.lognormal(7, 1.2, 500).astype(np.int64) + 1, CAP)
    cost_a = DriftingCost(L)
    a = BatchSampler(L, 4, policy, CAP, 4, seed=9, doc_cost=cost_a, lookahead_steps=6)
    it = iter(a)
    first = []
    for _ in range(9):  # stop inside a bucket block (steps 6..11)
        first.append(next(it))
        cost_a.version += 1
    state = json.loads(json.dumps(a.state_dict()))  # checkpoints are JSON/pickle friendly
    resume_version = cost_a.version
    rest_a = []
    for plan in it:
        rest_a.append(plan)
        cost_a.version += 1

    cost_b = DriftingCost(L)
    cost_b.version = resume_version  # the restored statistics
    b = BatchSampler(L, 4, policy, CAP, 4, seed=9, doc_cost=cost_b, lookahead_steps=6)
    b.load_state_dict(state)
    rest_b = []
    for plan in b:
        rest_b.append(plan)
        cost_b.version += 1
    assert [p.micro_batches for p in rest_a] == [p.micro_batches for p in rest_b]
    assert [p.step for p in rest_b] == list(range(9, a.steps_per_epoch))
    used = np.concatenate([p.all_docs() for p in first + rest_b])
    assert np.array_equal(np.sort(used), np.arange(L.size))
    assert (a.epoch, a.step) == (b.epoch, b.step) == (1, 0)


def test_resume_refuses_other_settings():
    L = np.arange(1, 101, dtype=np.int64)
    a = BatchSampler(L, 4, "kk-length", CAP, 4, seed=1)
    state = a.state_dict()
    with pytest.raises(BatchingError, match="world_size"):
        BatchSampler(L, 8, "kk-length", CAP, 4, seed=1).load_state_dict(state)
    with pytest.raises(BatchingError, match="lengths_digest"):
        BatchSampler(L[::-1].copy(), 4, "kk-length", CAP, 4, seed=1).load_state_dict(state)


def test_without_doc_cost_sparsebalance_falls_back_to_the_flop_proxy():
    L = np.arange(1, 41, dtype=np.int64) * 50
    plans = check_epoch(BatchSampler(L, 4, "sparsebalance", CAP, 3))
    assert all(p.predicted is None for p in plans)


def test_resume_when_the_loop_calls_plan_directly():
    """The training loop keeps its own (epoch, step) and calls plan(); state_dict must still carry the block."""
    rng = np.random.default_rng(5)
    L = np.minimum(rng.lognormal(7, 1.2, 400).astype(np.int64) + 1, CAP)
    cost_a = DriftingCost(L)
    a = BatchSampler(L, 4, "sparsebalance", CAP, 4, seed=3, doc_cost=cost_a, lookahead_steps=5)
    plans_a = []
    for step in range(a.steps_per_epoch):
        if step == 7:
            state = json.loads(json.dumps(a.state_dict()))
            version = cost_a.version
        plans_a.append(a.plan(0, step))
        cost_a.version += 1
    assert state["group"] is not None
    cost_b = DriftingCost(L)
    cost_b.version = version
    b = BatchSampler(L, 4, "sparsebalance", CAP, 4, seed=3, doc_cost=cost_b, lookahead_steps=5)
    b.load_state_dict(state)
    assert b.state_dict()["group"] == state["group"]  # a checkpoint right after resuming keeps the block
    for step in range(7, a.steps_per_epoch):
        assert b.plan(0, step).micro_batches == plans_a[step].micro_batches
        cost_b.version += 1
