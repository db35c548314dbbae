"""The sparse attention in training: gradient checkpointing recomputes the forward's blocks, bf16 autocast runs."""
from __future__ import annotations

import pytest
import torch

from sparsebalance_ft.attention import SparseAttentionController, SparsityConfig, register_sparse_attention
from sparsebalance_ft.attention import budget as attention_budget
from sparsebalance_ft.attention import register as attention_register
from sparsebalance_ft.train.model import enable_checkpointing

VOCAB = 64
DOCS = [100, 92]


def _model(layers: int = 2):
    from transformers import AutoModelForCausalLM, LlamaConfig

    register_sparse_attention()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(cfg).train()


def _batch():
    ids = torch.randint(0, VOCAB, (1, sum(DOCS)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    return ids, pos


def _counting(monkeypatch, module, name: str) -> list:
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _step(model, ctl, budget_after_forward: float | None = None):
    """Loss and gradients of one step; the budget may change between the forward and the backward (a
    recompute must still use the forward's blocks)."""
    ids, pos = _batch()
    loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
    if budget_after_forward is not None:
        ctl.set_budget(budget_after_forward)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_reuses_the_forward_selection(reentrant, monkeypatch):
    config = SparsityConfig(block_size=16, k_min=1, k_max=2, budget=0.3, recall_samples=2)
    plain = _model()
    ctl_plain = SparseAttentionController.attach(plain, config)
    loss_plain, grads_plain = _step(plain, ctl_plain)
    report_plain = ctl_plain.pop_report()

    checkpointed = _model()
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    ctl = SparseAttentionController.attach(checkpointed, config)
    selections = _counting(monkeypatch, attention_budget, "select_block_sets")  # the controller's select
    recalls = _counting(monkeypatch, attention_register, "sampled_recall_tensor")
    loss, grads = _step(checkpointed, ctl, budget_after_forward=0.9)
    report = ctl.pop_report()

    assert len(selections) == 2 and len(recalls) == 2  # one per layer: the recompute selects and samples nothing
    torch.testing.assert_close(loss, loss_plain, atol=0, rtol=0)
    assert grads.keys() == grads_plain.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_plain[name], atol=1e-6, rtol=1e-5, msg=name)
    assert report.forwards == 1 and report.layer_density == report_plain.layer_density
    assert report.layer_recall == report_plain.layer_recall
    assert sorted(n for n, _ in report.doc_densities) == sorted(DOCS)
    assert all(d < 1 for d in report.layer_density)


@pytest.mark.parametrize("budget", [0.3, 1.0])
def test_bf16_autocast_forward_and_backward(budget):
    """`training.mixed_precision: bf16` on CPU: the attention runs in bf16 under autocast, close to float32."""
    model = _model()
    ctl = SparseAttentionController.attach(model, SparsityConfig(block_size=16, k_min=1, k_max=2))
    ctl.set_budget(budget)
    ids, pos = _batch()
    reference = model(input_ids=ids, position_ids=pos, labels=ids).loss.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert abs(loss.item() - reference.item()) < 0.02 * reference.item()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__")


def _reads_of_a_training_step(monkeypatch, layers: int) -> int:
    """Python-level reads of tensor values (each a host synchronisation on a GPU) in one checkpointed
    forward and backward of a `layers`-layer model with the sparse attention and sampled recall, and the
    step's `pop_report`. The kernel is a GPU backend's (no host plan), stood in for by dense SDPA: the CPU
    torch kernel's plan reads its counts by design."""
    model = _model(layers)
    enable_checkpointing(model)
    ctl = SparseAttentionController.attach(model, SparsityConfig(block_size=16, k_min=1, k_max=2, budget=0.3,
                                                                 recall_samples=4))

    def gpu_kernel(q, k, v, *args, **kwargs):
        group = q.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True)

    monkeypatch.setattr(attention_register, "resolve_backend", lambda backend, device: "triton")
    monkeypatch.setattr(attention_register, "block_sparse_attention", gpu_kernel)
    ids, pos = _batch()
    with monkeypatch.context() as reading:
        reads = [_counting(reading, torch.Tensor, name) for name in _READS]
        model(input_ids=ids, position_ids=pos, labels=ids).loss.backward()
        report = ctl.pop_report()
    assert report.forwards == 1 and all(0 < d < 1 for d in report.layer_density)
    assert all(r is not None for r in report.layer_recall)
    return sum(len(r) for r in reads)


def test_no_host_read_per_layer_call(monkeypatch):
    """Selection, layout, recall and report read nothing per layer: doubling the layers adds no read (the
    documents are read once per forward and the report's counts once per step)."""
    assert _reads_of_a_training_step(monkeypatch, 4) == _reads_of_a_training_step(monkeypatch, 2)
