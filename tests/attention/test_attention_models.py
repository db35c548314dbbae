"""Plug-in registration with real decoder families, packed documents, LoRA training."""
from __future__ import annotations

import pytest
import torch

from sparsebalance_ft.attention import SparseAttentionController, SparsityConfig, register_sparse_attention

FAMILIES = ["llama", "qwen2", "mistral"]


def _config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    return MistralConfig(**common, sliding_window=None)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    dirs = {}
    for fam in FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(fam))
        path = tmp_path_factory.mktemp(fam)
        model.save_pretrained(path)
        dirs[fam] = path
    return dirs


def _load(path, impl):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.float32)


def test_register_is_idempotent():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    register_sparse_attention()
    register_sparse_attention()
    assert "sparsebalance" in AttentionInterface._global_mapping
    assert "sparsebalance" in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("family", FAMILIES)
def test_full_budget_matches_dense_and_documents_do_not_leak(family, model_dirs):
    register_sparse_attention()
    sparse, dense = _load(model_dirs[family], "sparsebalance"), _load(model_dirs[family], "sdpa")
    ctl = SparseAttentionController.attach(sparse, SparsityConfig(block_size=16, k_min=1, k_max=2, recall_samples=2))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (1, 230), generator=g)
    lens = [70, 100, 60]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        ref = torch.cat([dense(input_ids=part).logits for part in ids.split(lens, dim=1)], dim=1)
        ctl.set_budget(1.0)
        full = sparse(input_ids=ids, position_ids=pos).logits
        torch.testing.assert_close(full, ref, atol=1e-5, rtol=1e-4)
        ctl.set_budget(0.2)
        out = sparse(input_ids=ids, position_ids=pos).logits
        ids2 = ids.clone()
        ids2[0, :70] = (ids2[0, :70] + 1) % 96  # change the first document only
        out2 = sparse(input_ids=ids2, position_ids=pos).logits
    assert not torch.allclose(out[0, :70], out2[0, :70])
    torch.testing.assert_close(out[0, 70:], out2[0, 70:], atol=0, rtol=0)  # later documents never see it
    rep = ctl.pop_report()
    assert rep.forwards == 3 and len(rep.layer_density) == 2
    assert all(0 < d <= 1 for d in rep.layer_density)
    assert sorted(n for n, _ in rep.doc_densities[-3:]) == sorted(lens)
    assert any(d < 1 for _, d in rep.doc_densities)


def test_padding_and_generation_fallback(model_dirs):
    register_sparse_attention()
    sparse, dense = _load(model_dirs["llama"], "sparsebalance"), _load(model_dirs["llama"], "sdpa")
    SparseAttentionController.attach(sparse, SparsityConfig(block_size=16, budget=1.0))
    ids = torch.randint(0, 96, (2, 50), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 50, dtype=torch.long)
    mask[1, :7] = 0  # left padding
    with torch.no_grad():
        a = sparse(input_ids=ids, attention_mask=mask).logits
        b = dense(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(a[1, 7:], b[1, 7:], atol=1e-5, rtol=1e-4)
    gen_a = sparse.generate(ids[:1, :20], max_new_tokens=4, do_sample=False)
    gen_b = dense.generate(ids[:1, :20], max_new_tokens=4, do_sample=False)
    assert torch.equal(gen_a, gen_b)


def test_mistral_sliding_window_exact_at_full_budget(tmp_path):
    from transformers import AutoModelForCausalLM, MistralConfig

    register_sparse_attention()
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=40)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    sparse, dense = _load(tmp_path, "sparsebalance"), _load(tmp_path, "sdpa")
    ctl = SparseAttentionController.attach(sparse, SparsityConfig(block_size=16))
    ctl.set_budget(1.0)
    ids = torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(sparse(input_ids=ids).logits, dense(input_ids=ids).logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_training_loss_falls(family, model_dirs):
    from peft import LoraConfig, get_peft_model

    register_sparse_attention()
    model = _load(model_dirs[family], "sparsebalance")
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    ctl = SparseAttentionController.attach(model, SparsityConfig(block_size=16, k_min=2, k_max=3, budget=0.5))
    ctl.set_budget([0.3, 0.6])
    model.train()
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 96, (1, 24), generator=g)
    ids = base.repeat(1, 8)[:, :180]  # repetitive text: learnable in a few steps
    pos = torch.cat([torch.arange(100), torch.arange(80)])[None]
    labels = ids.clone()
    labels[0, 100] = -100
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        loss = model(input_ids=ids, position_ids=pos, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    rep = ctl.pop_report()
    assert rep.forwards == 6 and rep.layer_budget == [0.3, 0.6]
    assert rep.layer_density[0] <= rep.layer_density[1] < 1.0


def test_recall_samples_depend_on_the_documents_not_on_call_history(model_dirs):
    """Two models that see the same documents report the same recall, whatever each ran before."""
    register_sparse_attention()
    config = SparsityConfig(block_size=16, k_min=1, k_max=2, budget=0.3, recall_samples=3)
    first, second = (_load(model_dirs["llama"], "sparsebalance") for _ in range(2))
    ctl_first, ctl_second = (SparseAttentionController.attach(m, config) for m in (first, second))
    ids = torch.randint(0, 96, (1, 192), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in (112, 80)])[None]
    with torch.no_grad():
        second(input_ids=ids[:, :64])  # a different history: other calls before the measured one
        ctl_second.pop_report()
        first(input_ids=ids, position_ids=pos)
        second(input_ids=ids, position_ids=pos)
    recall_first, recall_second = ctl_first.pop_report().layer_recall, ctl_second.pop_report().layer_recall
    assert all(0 < r < 1 for r in recall_first)
    assert recall_first == recall_second
