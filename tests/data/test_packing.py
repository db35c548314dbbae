import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from sparsebalance_ft.data.packing import IGNORE_INDEX, model_inputs, pack_micro_batch


def test_pack_layout():
    batch = pack_micro_batch([np.array([5, 6, 7], np.int32), [8, 9], torch.tensor([10])])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9, IGNORE_INDEX]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 6] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert (batch["max_length_q"], batch["max_length_k"]) == (3, 3)
    for key in ("input_ids", "position_ids", "labels"):
        assert batch[key].dtype == torch.long and batch[key].shape == (1, 6)
    assert set(model_inputs(batch)) == {"input_ids", "position_ids", "labels", "use_cache"}
    assert model_inputs(batch)["use_cache"] is False


def _library_batch(features):
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)


def _assert_same_batch(ours, library):
    assert set(ours) == set(library)
    for key, value in library.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


def test_packing_equals_transformers_flattening_collator():
    """Same tensors as DataCollatorWithFlattening, the library call it stands in for (see the module docstring)."""
    gen = np.random.default_rng(3)
    docs = [gen.integers(0, 4096, n).astype(np.int32) for n in (57, 1, 31, 2, 40)]
    _assert_same_batch(pack_micro_batch(docs), _library_batch([{"input_ids": d} for d in docs]))


def test_packing_keeps_per_document_label_masks_like_the_collator():
    """Assistant-only labels (-100 outside assistant turns) survive packing; each document start is -100 too."""
    gen = np.random.default_rng(4)
    features = []
    for n in (20, 9, 33):
        ids = gen.integers(0, 4096, n)
        labels = np.where(gen.random(n) < 0.5, ids, IGNORE_INDEX)
        features.append({"input_ids": ids, "labels": labels})
    ours = pack_micro_batch(features)
    _assert_same_batch(ours, _library_batch(features))
    expected = np.concatenate([np.r_[IGNORE_INDEX, f["labels"][1:]] for f in features])
    assert ours["labels"][0].tolist() == expected.tolist()
    assert all(f["labels"].dtype == np.int64 for f in features)  # callers' arrays are not written to
    with pytest.raises(ValueError, match="document 0 .* 2 labels for 3 tokens"):
        pack_micro_batch([{"input_ids": [1, 2, 3], "labels": [1, 2]}])


def test_empty_micro_batch_is_none_and_empty_document_is_an_error():
    assert pack_micro_batch([]) is None
    with pytest.raises(ValueError, match="document 1 .* is empty"):
        pack_micro_batch([[1, 2], []])


def test_packing_corpus_documents(data_config, tiny_tokenizer):
    from sparsebalance_ft.data.corpus import load_corpus

    corpus = load_corpus(data_config(max_seq_len=256), tiny_tokenizer)
    batch = pack_micro_batch([corpus[0], corpus[1], corpus[2]])
    assert batch["input_ids"].shape[1] == int(corpus.lengths[:3].sum())
    assert batch["input_ids"][0, : len(corpus[0])].tolist() == corpus[0].tolist()


def _model(path, impl):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl).eval()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_documents_do_not_attend_to_each_other(tiny_model_dir, impl):
    """Logits of each packed document equal its logits alone, with a real tiny Llama."""
    model = _model(tiny_model_dir, impl)
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in (57, 31, 2, 40)]
    batch = pack_micro_batch(docs)
    with torch.no_grad():
        packed = model(**model_inputs(batch))
        alone = [model(input_ids=d[None], use_cache=False).logits[0] for d in docs]
        # the loss of the packed row equals the token-weighted loss of the documents alone
        losses = [model(input_ids=d[None], labels=d[None], use_cache=False).loss for d in docs]
    start = 0
    for doc, logits in zip(docs, alone):
        torch.testing.assert_close(packed.logits[0, start : start + len(doc)], logits, atol=1e-5, rtol=1e-5)
        start += len(doc)
    weights = torch.tensor([len(d) - 1 for d in docs], dtype=torch.float32)
    expected = (torch.stack(losses) * weights).sum() / weights.sum()
    torch.testing.assert_close(packed.loss, expected, atol=1e-5, rtol=1e-5)

    # the control: one unbroken position range (what packing without restarts would do) leaks
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"], use_cache=False).logits[0, 57 : 57 + 31]
    assert (leaky - alone[1]).abs().max() > 1e-3


def test_a_cache_defeats_packing_which_is_why_model_inputs_disables_it(tiny_model_dir):
    """transformers skips the packed mask when a cache exists; configs default to use_cache=True."""
    model = _model(tiny_model_dir, "sdpa")
    a, b = torch.arange(3, 40), torch.arange(100, 130)
    batch = pack_micro_batch([a, b])
    with torch.no_grad():
        alone = model(input_ids=b[None], use_cache=False).logits[0]
        with_cache = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0, len(a) :]
        safe = model(**model_inputs(batch)).logits[0, len(a) :]
    assert (with_cache - alone).abs().max() > 1e-3
    torch.testing.assert_close(safe, alone, atol=1e-5, rtol=1e-5)


def test_gradients_do_not_cross_documents(tiny_model_dir):
    """Training view: the loss on document B gives no gradient to document A's embeddings."""
    model = _model(tiny_model_dir, "sdpa").train()
    a, b = torch.arange(3, 30), torch.arange(200, 220)
    batch = pack_micro_batch([a, b])
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
    labels = batch["labels"].clone()
    labels[0, : len(a)] = IGNORE_INDEX  # loss on B only
    out = model(inputs_embeds=embeds, position_ids=batch["position_ids"], labels=labels, use_cache=False)
    out.loss.backward()
    assert embeds.grad[0, : len(a)].abs().max() == 0
    assert embeds.grad[0, len(a) :].abs().max() > 0


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_packing_holds_for_other_families(tmp_path, family):
    from sparsebalance_ft.modeling.tiny import init_tiny

    path = init_tiny(tmp_path / family, family=family, vocab_size=512, hidden_size=64, layers=2, heads=4, kv_heads=2)
    model = _model(path, "sdpa")
    a, b = torch.arange(3, 50), torch.arange(100, 125)
    with torch.no_grad():
        packed = model(**model_inputs(pack_micro_batch([a, b]))).logits[0, len(a) :]
        alone = model(input_ids=b[None], use_cache=False).logits[0]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
