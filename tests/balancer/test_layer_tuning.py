"""Layer-level DST: the pure rule, selections moved along the ranking within MIN..MAX and above the
anchors, the recompute reusing the first forward's decision, and uneven micro-batch counts on 2 gloo ranks."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsebalance_ft.attention.budget import SparseAttentionController
from sparsebalance_ft.attention.config import SparsityConfig
from sparsebalance_ft.attention.selection import make_layout, to_layout
from sparsebalance_ft.balancer.layer_tuning import LayerCost, LayerTuner, blend_counts, layer_target, move_toward
from sparsebalance_ft.train.model import enable_checkpointing

CFG = SparsityConfig(block_size=16, k_min=2, k_max=6, budget=0.5, sink_blocks=1, local_blocks=2)


def test_target_ignores_idle_ranks_and_respects_the_floor():
    rows = np.array([[0.0, 0.0, 0.0], [10.0, 6.0, 14.0], [6.0, 4.0, 9.0]])
    assert layer_target(rows) == pytest.approx(8.0)  # mean of the two working ranks
    rows = np.array([[20.0, 15.0, 25.0], [6.0, 4.0, 9.0]])
    assert layer_target(rows) == pytest.approx(15.0)  # the straggler cannot go below 15 at MIN


def test_target_rules_fastest_and_fill():
    rows = np.array([[10.0, 6.0, 14.0], [6.0, 4.0, 9.0]])
    assert layer_target(rows, "fastest") == pytest.approx(6.0)  # the slowest rank at MIN
    assert layer_target(rows, "fill") == pytest.approx(10.0)  # the slowest rank now: nobody is cut


@pytest.mark.parametrize("peer_scale, moved_sign", [(0.2, 0), (5.0, +1)])
def test_fill_never_cuts_and_fills_a_waiting_rank(peer_scale, moved_sign):
    """Target fill: the slower rank keeps its blocks; the faster one adds blocks up to its time (MAX at most)."""
    select_at = _layer_inputs()
    sel, lo, hi = select_at(0.5), select_at(0.1), select_at(0.9)
    now = float(sel.counts.sum())
    tuner = ScriptedTuner(peer=[now * peer_scale, now * peer_scale * 0.5, now * peer_scale * 2], target="fill")
    tuner.begin_step([LayerCost(0.0, 1.0)], 1)
    out = tuner.adjust(0, sel, lo, hi)
    moved = int(out.counts.sum() - sel.counts.sum())
    assert np.sign(moved) == moved_sign
    if moved_sign:  # the peer is 5x slower: this rank takes every block up to MAX
        assert torch.equal(out.counts, hi.counts)


def test_move_toward_is_bounded_and_proportional():
    assert move_toward(8.0, 10.0, 6.0, 14.0) == pytest.approx(-0.5)
    assert move_toward(8.0, 6.0, 4.0, 9.0) == pytest.approx(2.0 / 3.0)
    assert move_toward(1.0, 10.0, 6.0, 14.0) == -1.0  # cut to MIN, not below
    assert move_toward(100.0, 6.0, 4.0, 9.0) == 1.0  # raised to MAX, not above
    assert move_toward(10.2, 10.4, 6.0, 14.0, tolerance=0.05) == 0.0


def test_blend_counts_keeps_exact_totals_and_bounds():
    now = torch.tensor([[3, 3, 4, 5]])
    lo = torch.tensor([[2, 2, 2, 2]])
    hi = torch.tensor([[6, 7, 8, 9]])
    for alpha in (-1.0, -0.3, 0.0, 0.25, 1.0):
        out = blend_counts(now, lo, hi, alpha)
        assert torch.all(out >= lo) and torch.all(out <= hi)
        span = (now - lo) if alpha < 0 else (hi - now)
        assert int(out.sum() - now.sum()) == round(alpha * int(span.sum()))


def _layer_inputs(seed=0, length=160):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, length, 16, generator=g)
    k = torch.randn(1, 2, length, 16, generator=g)
    layout = make_layout([length], CFG.block_size, "cpu", length=length)
    qp, kp = to_layout(q, layout)[0], to_layout(k, layout)[0]

    def select_at(b):
        return SparseAttentionController(CFG).select(qp, kp, layout, b, scale=0.25)

    return select_at


class ScriptedTuner(LayerTuner):
    """The exchange answers with a scripted peer row (a one-process stand-in for the all_gather)."""

    def __init__(self, peer, **kw):
        super().__init__(0.1, 0.9, num_layers=1, **kw)
        self.peer = np.asarray(peer, dtype=np.float64)
        self.sent = []

    def _exchange(self, row):
        self._done += 1
        self.sent.append(row.copy())
        return np.vstack([row, self.peer])


@pytest.mark.parametrize("peer_scale, direction", [(0.2, -1), (5.0, +1)])
def test_straggler_drops_lowest_ranked_and_waiter_adds_next_ranked(peer_scale, direction):
    select_at = _layer_inputs()
    sel = select_at(0.5)
    lo, hi = select_at(0.1), select_at(0.9)
    per_block = 1.0
    now = float(sel.counts.sum())
    tuner = ScriptedTuner(peer=[now * peer_scale, now * peer_scale * 0.5, now * peer_scale * 2])
    tuner.begin_step([LayerCost(0.0, per_block)], 1)
    out = tuner.adjust(0, sel, lo, hi)
    moved = int(out.counts.sum() - sel.counts.sum())
    assert np.sign(moved) == direction
    assert torch.all(out.counts >= lo.counts) and torch.all(out.counts <= hi.counts)
    for h in range(out.counts.shape[0]):
        for i in range(out.counts.shape[1]):
            kept = out.indices[h, i, : out.counts[h, i]].tolist()
            ranked = hi.indices[h, i, : hi.counts[h, i]].tolist()
            assert kept == ranked[: len(kept)]  # a prefix of the one ranking
            assert set(lo.indices[h, i, : lo.counts[h, i]].tolist()) <= set(kept)  # anchors and the MIN floor kept


def test_recompute_in_backward_reuses_the_decision_without_communicating():
    select_at = _layer_inputs(1)
    sel = select_at(0.5)
    now = float(sel.counts.sum())
    tuner = ScriptedTuner(peer=[0.3 * now, 0.2 * now, 0.5 * now])
    tuner.begin_step([LayerCost(0.0, 1.0)], 1)
    first = tuner.adjust(0, sel, select_at(0.1), select_at(0.9))
    again = tuner.adjust(0, select_at(0.5), select_at(0.1), select_at(0.9), in_backward=True)
    assert again is first and len(tuner.sent) == 1
    tuner.finish_step()
    assert len(tuner.sent) == 1  # nothing left to join


def test_gradient_checkpointing_recompute_selects_the_same_blocks(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from sparsebalance_ft.attention import SparseAttentionController, register_sparse_attention

    register_sparse_attention()
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sparsebalance")
    enable_checkpointing(model)
    model.train()
    ctl = SparseAttentionController.attach(model, SparsityConfig(block_size=16, k_min=1, k_max=2))

    class Recording(LayerTuner):
        def __init__(self):
            super().__init__(0.1, 0.9, num_layers=2)
            self.exchanges, self.forward_sel, self.backward_sel = 0, {}, {}

        def _exchange(self, row):  # pretend a peer twice as busy: this rank adds blocks
            self._done += 1
            self.exchanges += 1
            return np.vstack([row, 2.0 * row + 1.0])

        def adjust(self, layer, sel, lo_sel, hi_sel, in_backward=False):
            out = super().adjust(layer, sel, lo_sel, hi_sel, in_backward)
            (self.backward_sel if in_backward else self.forward_sel)[layer] = out.indices.clone(), out.counts.clone()
            return out

    tuner = Recording()
    ctl.layer_tuner = tuner
    tuner.begin_step([LayerCost(0.0, 1.0)], 1)
    ids = torch.randint(0, 64, (1, 96))
    model(input_ids=ids, labels=ids).loss.backward()
    tuner.finish_step()
    assert tuner.exchanges == 2  # one per layer; the recompute did not communicate
    assert tuner.backward_sel == {}  # the recompute reused the attention's cached route, never asking the tuner
    for layer in (0, 1):  # and that cached route is the tuner's adjusted selection, not the rank's own
        kept = ctl._routes[(layer, 0)].selection
        assert torch.equal(kept.indices, tuner.forward_sel[layer][0]) and torch.equal(kept.counts, tuner.forward_sel[layer][1])


def test_report_remembers_the_density_at_the_budget_not_the_moved_one(tmp_path):
    """A layer tuner that adds blocks changes what ran (layer_density), not the documents' density at the
    rank's budget (doc_densities, what the density knowledge remembers): that equals a forward without it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from sparsebalance_ft.attention import SparseAttentionController, register_sparse_attention

    register_sparse_attention()
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sparsebalance")
    ctl = SparseAttentionController.attach(model, SparsityConfig(block_size=16, k_min=1, k_max=4))
    ids = torch.randint(0, 64, (1, 160), generator=torch.Generator().manual_seed(0))

    def forward(tuner):
        ctl.layer_tuner = tuner
        if tuner is not None:
            tuner.begin_step([LayerCost(0.0, 1.0)], 1)
        with torch.no_grad():
            model(input_ids=ids)
        if tuner is not None:
            tuner.finish_step()
        return ctl.pop_report()

    class BusyPeer(LayerTuner):  # a peer twice as busy: this rank fills, adding its next-ranked blocks
        def _exchange(self, row):
            self._done += 1
            return np.vstack([row, 2.0 * row + 1.0])

    alone = forward(None)
    moved = forward(BusyPeer(0.1, 0.9, num_layers=2, target="fill"))
    assert all(m > a for m, a in zip(moved.layer_density, alone.layer_density))  # more ran
    assert moved.doc_densities == alone.doc_densities  # the same density at the budget



def _uneven_worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        layers = 3
        gathered = []

        class Logged(LayerTuner):
            def _exchange(self, row):
                out = super()._exchange(row)
                gathered.append(out.tolist())
                return out

        tuner = Logged(0.1, 0.9, num_layers=layers)
        real = 2 if rank == 0 else 1  # rank 1 has one real micro-batch of the step's two
        tuner.begin_step([LayerCost(0.01 * (rank + 1), 0.001)] * real, 2)
        counts = []
        for m in range(real):
            for layer in range(layers):
                select_at = _layer_inputs(seed=10 * rank + m + layer, length=160 + 32 * rank)
                counts.append(int(tuner.adjust(layer, select_at(0.5), select_at(0.1), select_at(0.9)).counts.sum()))
        tuner.finish_step()
        dist.barrier()
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump({"gathered": gathered, "counts": counts, "seconds": tuner.pop_stats()["layer_exchange_seconds"]}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_uneven_micro_batch_counts_on_two_gloo_ranks(tmp_path, free_port):
    mp.spawn(_uneven_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(r0["gathered"]) == len(r1["gathered"]) == 6  # 2 micro-batches x 3 layers on both ranks
    assert r0["gathered"] == r1["gathered"]  # the same array, so the same rule, on both ranks
    assert all(row[1] == [0.0, 0.0, 0.0] for row in r1["gathered"][3:])  # rank 1's padding exchanges
    assert r0["seconds"] > 0.0 and r1["seconds"] > 0.0  # six exchanges each were timed (0: nothing recorded)
