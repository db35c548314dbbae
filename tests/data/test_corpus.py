import json
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from sparsebalance_ft.data import corpus as corpus_mod
from sparsebalance_ft.data.corpus import TokenizedCorpus, load_corpus
from sparsebalance_ft.data.sources import DataError


@pytest.fixture
def count_tokenize(monkeypatch):
    calls = []
    real = corpus_mod._tokenize_texts

    def counting(tokenizer, texts, add_special_tokens):
        calls.append(len(texts))
        return real(tokenizer, texts, add_special_tokens)

    monkeypatch.setattr(corpus_mod, "_tokenize_texts", counting)
    return calls


def test_tokenizes_appends_eos_and_matches_tokenizer(data_config, tiny_tokenizer, text_corpus_dir):
    corpus = load_corpus(data_config(max_seq_len=100_000, min_seq_len=2), tiny_tokenizer)
    files = sorted(text_corpus_dir.iterdir())
    assert len(corpus) == len(files) == 24
    for i in (0, 5, -1):
        expected = tiny_tokenizer(files[i].read_text())["input_ids"] + [tiny_tokenizer.eos_token_id]
        assert corpus[i].dtype == np.int32 and corpus[i].tolist() == expected
    assert corpus.lengths.tolist() == [len(d) for d in corpus]
    assert corpus.lengths.min() > 50 and corpus.lengths.max() > 2000  # varied lengths for batching tests
    assert isinstance(corpus.tokens, np.memmap)
    s = corpus.summary()
    assert s["documents_read"] == s["documents"] == 24 and s["truncated"] == 0 and s["cache_hit"] is False
    assert s["tokens"] == corpus.total_tokens == int(corpus.lengths.sum())


def test_cache_is_reused_without_retokenizing(data_config, tiny_tokenizer, count_tokenize):
    config = data_config()
    first = load_corpus(config, tiny_tokenizer)
    assert count_tokenize and first.summary()["cache_hit"] is False
    entries = [p for p in os.scandir(config.cache_dir) if p.is_dir()]
    assert len(entries) == 1 and not [p for p in os.listdir(config.cache_dir) if p.startswith(".tmp")]
    count_tokenize.clear()
    second = load_corpus(config, tiny_tokenizer)
    assert count_tokenize == [] and second.summary()["cache_hit"] is True
    assert np.array_equal(first.lengths, second.lengths) and np.array_equal(first[3], second[3])
    # the length policy is applied on load: changing it reuses the same tokenization
    third = load_corpus(data_config(max_seq_len=1024, too_long="drop"), tiny_tokenizer)
    assert 0 < len(third) < len(first)
    assert count_tokenize == [] and third.summary()["cache_hit"] is True


def test_cache_invalidated_by_source_change_and_tokenizer_settings(tmp_path, tiny_tokenizer, count_tokenize):
    from sparsebalance_ft.recipe import DataConfig

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "hello world " * 20}) + "\n")
    config = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), min_seq_len=2)
    assert len(load_corpus(config, tiny_tokenizer)) == 1
    time.sleep(0.01)
    path.write_text(json.dumps({"text": "hello world " * 20}) + "\n" + json.dumps({"text": "more text " * 9}) + "\n")
    count_tokenize.clear()
    assert len(load_corpus(config, tiny_tokenizer)) == 2 and count_tokenize
    count_tokenize.clear()
    assert len(load_corpus(config.model_copy(update={"max_documents": 1}), tiny_tokenizer)) == 1 and count_tokenize


def test_truncate_drop_error_and_min_len(tmp_path, tiny_tokenizer):
    from sparsebalance_ft.recipe import DataConfig

    path = tmp_path / "d.jsonl"
    rows = [{"text": "word " * 5}, {"text": "word " * 200}, {"text": "x"}, {"text": "word " * 30}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = dict(path=str(path), cache_dir=str(tmp_path / "cache"), max_seq_len=64, min_seq_len=4)
    raw = load_corpus(DataConfig(**{**base, "max_seq_len": 10_000, "min_seq_len": 2}), tiny_tokenizer).lengths
    assert raw[1] > 64 and raw[2] < 4 and 4 <= raw[0] < 64 and 4 <= raw[3] < 64

    truncated = load_corpus(DataConfig(**base, too_long="truncate"), tiny_tokenizer)
    assert truncated.lengths.tolist() == [raw[0], 64, raw[3]]
    assert truncated[1].tolist() == tiny_tokenizer(rows[1]["text"])["input_ids"][:64]
    s = truncated.summary()
    assert (s["documents_read"], s["documents"], s["truncated"], s["dropped_too_long"], s["dropped_too_short"]) == (4, 3, 1, 0, 1)
    assert "1 truncated to 64" in truncated.describe()

    dropped = load_corpus(DataConfig(**base, too_long="drop"), tiny_tokenizer)
    assert dropped.lengths.tolist() == [raw[0], raw[3]]
    s = dropped.summary()
    assert (s["documents"], s["truncated"], s["dropped_too_long"], s["dropped_too_short"]) == (2, 0, 1, 1)
    assert dropped[1].tolist() == truncated[2].tolist()

    with pytest.raises(DataError) as e:
        load_corpus(DataConfig(**base, too_long="error"), tiny_tokenizer)
    assert str(e.value).startswith(f"{path}:2: document has {raw[1]} tokens, above data.max_seq_len=64")

    with pytest.raises(DataError, match="no documents left"):
        load_corpus(DataConfig(**{**base, "min_seq_len": 64, "too_long": "drop"}), tiny_tokenizer)
    with pytest.raises(DataError, match=r"min_seq_len \(100\) is above data.max_seq_len \(64\)"):
        load_corpus(DataConfig(**{**base, "min_seq_len": 100}), tiny_tokenizer)


def test_chat_corpus_tokens(tmp_path, tiny_tokenizer):
    from sparsebalance_ft.recipe import DataConfig

    path = tmp_path / "c.jsonl"
    chat = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    path.write_text(json.dumps({"messages": chat}) + "\n")
    corpus = load_corpus(
        DataConfig(path=str(path), messages_field="messages", cache_dir=str(tmp_path / "c"), min_seq_len=2), tiny_tokenizer
    )
    ids = corpus[0].tolist()
    assert ids[0] == tiny_tokenizer.bos_token_id and ids[-1] == tiny_tokenizer.eos_token_id
    # the template's text, special tokens parsed as such, then the document's EOS
    assert tiny_tokenizer.decode(ids) == tiny_tokenizer.apply_chat_template(chat, tokenize=False) + "<|eos|>"
    assert ids.count(tiny_tokenizer.bos_token_id) == 1 and ids.count(tiny_tokenizer.eos_token_id) == 3


def test_errors_surface_from_load_corpus(tmp_path, tiny_tokenizer):
    from sparsebalance_ft.recipe import DataConfig

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        load_corpus(DataConfig(path=str(path), cache_dir=str(tmp_path / "c")), tiny_tokenizer)
    assert not [p for p in os.listdir(tmp_path / "c") if p.startswith(".tmp")]  # no half-written cache left
    with pytest.raises(DataError, match="data path not found"):
        load_corpus(DataConfig(path=str(tmp_path / "none"), cache_dir=str(tmp_path / "c")), tiny_tokenizer)


def _load_in_child(config_json, tokenizer_dir, queue):
    from sparsebalance_ft.recipe import DataConfig

    corpus = load_corpus(DataConfig.model_validate_json(config_json), str(tokenizer_dir))
    queue.put((corpus.summary()["cache_hit"], corpus.lengths.tolist()))


@pytest.mark.slow
def test_two_ranks_at_once_share_one_cache_entry(data_config, tiny_model_dir):
    config = data_config()
    # fork keeps this fast (no re-import of torch); the children only tokenize
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_load_in_child, args=(config.model_dump_json(), tiny_model_dir, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(hit for hit, _ in results) == [False, True]  # one tokenized, the other waited and reused it
    assert results[0][1] == results[1][1]
    assert len([p for p in os.listdir(config.cache_dir) if p.startswith("tokens-") and not p.endswith(".lock")]) == 1


def test_from_documents_and_indexing():
    corpus = TokenizedCorpus.from_documents([[5, 6, 7], [8], [9, 10]])
    assert corpus.lengths.tolist() == [3, 1, 2] and len(corpus) == 3
    assert corpus[-1].tolist() == [9, 10] and corpus[1].dtype == np.int32
    with pytest.raises(IndexError):
        corpus[3]
    assert [d.tolist() for d in corpus] == [[5, 6, 7], [8], [9, 10]]


def test_progress_bar_does_not_change_results(data_config, tiny_tokenizer):
    shown = load_corpus(data_config(), tiny_tokenizer, progress=True)
    assert type(shown[0]) is np.ndarray and not shown[0].flags.writeable
    assert load_corpus(data_config(), tiny_tokenizer, progress=False).lengths.tolist() == shown.lengths.tolist()
