"""Family matrix: every decoder family runs the sparse attention exactly (against its own eager attention, at
full budget) or refuses in one line. Tiny random models built from their configs; packed documents stay apart.

The window (24) and chunk (32) are shorter than the documents, so layers that carry them only in their mask
function (PhiMoE, Qwen2-MoE, Llama4) differ from plain causal attention, and GPT-OSS's sink logits change
every softmax: each of those families fails here if its window, chunk or sinks are dropped.
"""
from __future__ import annotations

import pytest
import torch

from sparsebalance_ft.attention import SparseAttentionController, SparsityConfig, register_sparse_attention

VOCAB, WINDOW, CHUNK = 96, 24, 32
DOCS = [40, 57, 35]
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)
_MOE = dict(num_local_experts=2, num_experts_per_tok=1)


def _config(family: str):
    import transformers as T

    sliding_then_full = ["sliding_attention", "full_attention"]
    return {
        "llama": lambda: T.LlamaConfig(**_COMMON),
        "mistral": lambda: T.MistralConfig(**_COMMON, sliding_window=WINDOW),
        "qwen2-sliding": lambda: T.Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                               max_window_layers=2),
        "qwen3": lambda: T.Qwen3Config(**_COMMON, head_dim=8),
        "phi3": lambda: T.Phi3Config(**_COMMON),
        "olmo2": lambda: T.Olmo2Config(**_COMMON),
        "gemma3": lambda: T.Gemma3TextConfig(**_COMMON, head_dim=8, sliding_window=WINDOW, layer_types=sliding_then_full),
        "gpt-oss-sinks": lambda: T.GptOssConfig(**_COMMON, **_MOE, head_dim=8, sliding_window=WINDOW,
                                                layer_types=sliding_then_full),
        "phimoe-window": lambda: T.PhimoeConfig(**_COMMON, **_MOE, sliding_window=WINDOW),
        "qwen2-moe-window": lambda: T.Qwen2MoeConfig(**_COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                                     max_window_layers=2, num_experts=2, num_experts_per_tok=1,
                                                     moe_intermediate_size=16, shared_expert_intermediate_size=16),
        "llama4-chunked": lambda: T.Llama4TextConfig(**_COMMON, **_MOE, head_dim=8, attention_chunk_size=CHUNK,
                                                     intermediate_size_mlp=48, no_rope_layers=[1, 0]),
        "gemma2-softcap": lambda: T.Gemma2Config(**_COMMON, head_dim=8, sliding_window=WINDOW),
    }[family]()


EXACT = ["llama", "mistral", "qwen2-sliding", "qwen3", "phi3", "olmo2", "gemma3", "gpt-oss-sinks", "phimoe-window",
         "qwen2-moe-window", "llama4-chunked"]


def _eager_model(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config(family)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).eval()


def _packed():
    ids = torch.randint(0, VOCAB, (1, sum(DOCS)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    return ids, pos


@pytest.mark.parametrize("family", EXACT)
def test_full_budget_equals_eager_and_documents_stay_apart(family):
    register_sparse_attention()
    model = _eager_model(family)
    ids, pos = _packed()
    with torch.no_grad():
        # eager per document (not on the packed row: some families, GPT-OSS among them, do not mask packed
        # documents apart in eager attention)
        reference = torch.cat([model(input_ids=part).logits for part in ids.split(DOCS, dim=1)], dim=1)
        ctl = SparseAttentionController.attach(model, SparsityConfig(block_size=16, k_min=1, k_max=2))
        ctl.set_budget(1.0)
        full = model(input_ids=ids, position_ids=pos).logits
        ctl.set_budget(0.2)
        sparse = model(input_ids=ids, position_ids=pos).logits
        changed = ids.clone()
        changed[0, : DOCS[0]] = (changed[0, : DOCS[0]] + 1) % VOCAB  # the first document only
        sparse_changed = model(input_ids=changed, position_ids=pos).logits
    assert (full - reference).abs().max() <= 1e-4
    assert not torch.equal(sparse[0, : DOCS[0]], sparse_changed[0, : DOCS[0]])
    assert torch.equal(sparse[0, DOCS[0]:], sparse_changed[0, DOCS[0]:])  # later documents never see it


@pytest.mark.parametrize("family", ["gpt-oss-sinks", "phimoe-window", "llama4-chunked"])
def test_generation_with_a_cache_equals_eager(family):
    """Decoding with a cache runs dense on transformers' own mask (window, chunk) with the sinks."""
    register_sparse_attention()
    model = _eager_model(family)
    prompt = torch.randint(1, VOCAB, (1, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=prompt).logits
        expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
        SparseAttentionController.attach(model, SparsityConfig(block_size=16, budget=1.0))
        torch.testing.assert_close(model(input_ids=prompt).logits, ref, atol=1e-4, rtol=0)
        assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False), expected)


def test_softcapping_is_refused_in_one_line():
    model = _eager_model("gemma2-softcap")
    with pytest.raises(ValueError, match=r"no attention logit softcapping \(gemma2: attn_logit_softcapping=50.0\)"):
        SparseAttentionController.attach(model, SparsityConfig(block_size=16))


def test_attention_dropout_in_training_is_refused_in_one_line():
    from transformers import AutoModelForCausalLM, LlamaConfig

    register_sparse_attention()
    model = AutoModelForCausalLM.from_config(LlamaConfig(**_COMMON, attention_dropout=0.1)).train()
    SparseAttentionController.attach(model, SparsityConfig(block_size=16))
    ids = torch.randint(0, VOCAB, (1, 40))
    with pytest.raises(ValueError, match=r"no attention dropout \(got 0.1 in training\)"):
        model(input_ids=ids)
    with torch.no_grad():
        model.eval()(input_ids=ids)  # outside training the dropout is 0: runs
