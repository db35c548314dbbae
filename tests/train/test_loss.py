"""The shared loss equals the plain full-logit cross-entropy of the HF forward, in value and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from sparsebalance_ft.train import loss as loss_module
from sparsebalance_ft.train.loss import (
    LossConfigError,
    chunk_tokens,
    micro_batch_loss,
    resolve_mode,
    split_causal_lm,
    token_loss,
)

VOCAB, TOKENS = 320, 96
SMALL_CHUNK_BYTES = 4 * VOCAB * 20  # 20 tokens a chunk: five chunks, the last one short


def small_llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tied, attn_implementation="sdpa")
    return LlamaForCausalLM(config).float()


def with_lora(model, modules_to_save=None):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             modules_to_save=modules_to_save, task_type="CAUSAL_LM"))
    for name, p in model.named_parameters():  # LoRA B starts at zero; make every gradient path non-trivial
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def packed_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    """Three packed documents, labels -100 at each document start and on a stretch inside the second."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=g)
    lengths = [30, 50, 16]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = ids.clone()
    labels[0, [0, 30, 80]] = -100
    labels[0, 40:52] = -100
    return {"input_ids": ids, "position_ids": position_ids, "labels": labels}


def reference_loss(model, batch) -> tuple[torch.Tensor, int]:
    """The plain path: the HF forward's logits for every token, cross-entropy over all of them."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    targets = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    return loss, int((targets != -100).sum())


def loss_and_grads(model, compute, global_targets: int):
    model.zero_grad(set_to_none=True)
    loss, count = compute()
    (loss / global_targets).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.detach(), count, grads


def assert_same(expected, actual):
    (ref_loss, ref_count, ref_grads), (loss, count, grads) = expected, actual
    assert count == ref_count
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys() and ref_grads
    for name, g in ref_grads.items():
        assert g.abs().max() > 0, f"{name}: no gradient reached it"
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=name)


MODELS = {
    "full model, tied embeddings": lambda: small_llama(tied=True),
    "LoRA, tied embeddings": lambda: with_lora(small_llama(tied=True)),
    "LoRA, untied head in modules_to_save": lambda: with_lora(small_llama(tied=False), ["lm_head"]),
}


@pytest.mark.parametrize("mode", ["full", "chunked"])
@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_loss_and_gradients_equal_the_full_logit_reference(make, mode, monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_LOGIT_BYTES", SMALL_CHUNK_BYTES)
    model = make().train()
    batch = packed_batch()
    global_targets = 3 * TOKENS  # the trainer divides by every rank's target count, not this batch's
    expected = loss_and_grads(model, lambda: reference_loss(model, batch), global_targets)
    actual = loss_and_grads(model, lambda: micro_batch_loss(model, batch, mode), global_targets)
    assert_same(expected, actual)


def test_modules_to_save_head_is_the_one_that_trains(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_LOGIT_BYTES", SMALL_CHUNK_BYTES)
    model = with_lora(small_llama(tied=False), ["lm_head"]).train()
    loss, _ = micro_batch_loss(model, packed_batch(), "chunked")
    loss.backward()
    head = split_causal_lm(model).head
    trained = [n for n, p in head.named_parameters() if p.grad is not None]
    assert trained and all("modules_to_save" in n for n in trained)


def test_per_token_losses_match_in_chunks(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_LOGIT_BYTES", SMALL_CHUNK_BYTES)
    model = small_llama(tied=True).eval()
    parts = split_causal_lm(model)
    hidden = torch.randn(TOKENS, 32)
    targets = torch.randint(0, VOCAB, (TOKENS,))
    targets[5] = -100
    with torch.no_grad():
        expected = F.cross_entropy(model.lm_head(hidden), targets, ignore_index=-100, reduction="none")
        chunked = token_loss(parts, hidden, targets, "chunked", reduction="none")
    torch.testing.assert_close(chunked, expected, rtol=1e-6, atol=1e-6)
    assert chunked[5] == 0


def test_chunked_loss_never_keeps_a_whole_sequence_of_logits(monkeypatch):
    """What autograd saves for backward: full keeps [tokens, vocab] tensors, chunked at most the hidden states."""
    monkeypatch.setattr(loss_module, "CHUNK_LOGIT_BYTES", SMALL_CHUNK_BYTES)
    parts = split_causal_lm(small_llama(tied=True))
    hidden = torch.randn(TOKENS, 32, requires_grad=True)
    targets = torch.randint(0, VOCAB, (TOKENS,))

    def largest_saved(mode: str) -> int:
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            token_loss(parts, hidden, targets, mode)
        return max(sizes)

    assert largest_saved("full") >= TOKENS * VOCAB
    assert largest_saved("chunked") <= TOKENS * 32  # slices of the hidden states, never logits


def test_chunk_size_bounds_the_logits_whatever_the_vocabulary():
    for vocab in (49_152, 128_256):
        assert chunk_tokens(vocab) * vocab * 4 <= loss_module.CHUNK_LOGIT_BYTES
        assert chunk_tokens(vocab) >= 256


def test_modes_resolve_on_cpu_with_one_line_errors():
    parts = split_causal_lm(small_llama(tied=True))
    cpu = torch.device("cpu")
    assert resolve_mode("auto", parts, cpu) == "chunked"
    assert resolve_mode("full", parts, cpu) == "full"
    with pytest.raises(LossConfigError, match=r"^training.loss: fused: the fused loss runs on CUDA only"):
        resolve_mode("fused", parts, cpu)
    with pytest.raises(LossConfigError, match=r"^training.loss: expected one of auto, full, chunked, fused"):
        resolve_mode("bogus", parts, cpu)


def test_fused_is_refused_for_a_lora_wrapped_head(monkeypatch):
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(loss_module, "_liger_loss", lambda: object)
    model = get_peft_model(small_llama(tied=False), LoraConfig(r=2, target_modules=["lm_head"], task_type="CAUSAL_LM"))
    reason = loss_module.fused_unavailable(split_causal_lm(model), torch.device("cuda"))
    assert reason and "plain linear LM head" in reason
    plain = loss_module.fused_unavailable(split_causal_lm(with_lora(small_llama(False), ["lm_head"])), torch.device("cuda"))
    assert plain is None  # the modules_to_save copy is a plain linear layer


def test_logit_soft_capping_is_applied_like_the_model_does(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_LOGIT_BYTES", SMALL_CHUNK_BYTES)
    model = small_llama(tied=True)
    model.config.final_logit_softcapping = 3.0
    parts = split_causal_lm(model)
    hidden = torch.randn(TOKENS, 32)
    targets = torch.randint(0, VOCAB, (TOKENS,))
    with torch.no_grad():
        capped = torch.tanh(model.lm_head(hidden) / 3.0) * 3.0
        expected = F.cross_entropy(capped, targets, reduction="sum")
        torch.testing.assert_close(token_loss(parts, hidden, targets, "chunked"), expected, rtol=1e-5, atol=0)
