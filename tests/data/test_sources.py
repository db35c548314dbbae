import json

import pytest

from sparsebalance_ft.data.sources import DataError, detect_format, read_documents, source_files
from sparsebalance_ft.recipe import DataConfig


def cfg(path, **kw):
    return DataConfig(path=str(path), **kw)


def texts(config, tokenizer=None):
    return [d.text for d in read_documents(config, tokenizer)]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]


# ------------------------------------------------------------------ formats


def test_jsonl_text_field_and_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "one"}, "", {"body": "two", "text": "x"}])
    assert texts(cfg(path)) == ["one", "x"]
    assert texts(cfg(path, max_documents=1)) == ["one"]
    docs = list(read_documents(cfg(path)))
    assert docs[1].where == f"{path}:3"


def test_jsonl_chat_messages_rendered_with_template(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    (text,) = texts(cfg(path, messages_field="messages"), tiny_tokenizer)
    assert text == "<|bos|><|user|>\nWhat is 2+2?<|eos|>\n<|assistant|>\n4<|eos|>\n"


def test_parquet_text_and_chat(tmp_path, tiny_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b", "c"], "n": [1, 2, 3]}), tmp_path / "t.parquet")
    assert detect_format(cfg(tmp_path / "t.parquet")) == "parquet"
    assert texts(cfg(tmp_path / "t.parquet")) == ["a", "b", "c"]
    assert texts(cfg(tmp_path / "t.parquet", max_documents=2)) == ["a", "b"]
    pq.write_table(pa.table({"messages": [CHAT]}), tmp_path / "c.parquet")
    (text,) = texts(cfg(tmp_path / "c.parquet", messages_field="messages"), tiny_tokenizer)
    assert "<|assistant|>\n4<|eos|>" in text


def test_text_folder_glob_sorted_and_hidden_skipped(tmp_path):
    root = tmp_path / "texts"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("bee")
    (root / "a.md").write_text("ay")
    (root / "sub" / "c.txt").write_text("sea")
    (root / ".hidden.txt").write_text("no")
    assert detect_format(cfg(root)) == "text"
    assert texts(cfg(root)) == ["ay", "bee", "sea"]
    assert texts(cfg(root, text_glob="**/*.txt")) == ["bee", "sea"]
    assert texts(cfg(root, text_glob="*.txt")) == ["bee"]
    assert texts(cfg(root / "b.txt")) == ["bee"]  # a single text file is one document


def test_real_text_corpus_fixture(text_corpus_dir, jsonl_corpus):
    folder = texts(cfg(text_corpus_dir))
    assert len(folder) == 24 and folder == texts(cfg(jsonl_corpus))


def test_folder_of_jsonl_autodetected(tmp_path):
    write_jsonl(tmp_path / "1.jsonl", [{"text": "x"}])
    write_jsonl(tmp_path / "2.jsonl", [{"text": "y"}])
    assert detect_format(cfg(tmp_path)) == "jsonl"
    assert texts(cfg(tmp_path)) == ["x", "y"]


def test_saved_dataset_and_dataset_dict(tmp_path, tiny_tokenizer):
    import datasets

    datasets.Dataset.from_dict({"text": ["p", "q"]}).save_to_disk(str(tmp_path / "ds"))
    assert detect_format(cfg(tmp_path / "ds")) == "saved"
    assert texts(cfg(tmp_path / "ds")) == ["p", "q"]
    assert source_files(cfg(tmp_path / "ds"))  # its files feed the cache fingerprint
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"messages": [CHAT]}), "test": datasets.Dataset.from_dict({"messages": [CHAT[:1]]})}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    (text,) = texts(cfg(tmp_path / "dd", messages_field="messages"), tiny_tokenizer)
    assert text.endswith("<|assistant|>\n4<|eos|>\n")
    with pytest.raises(DataError, match=r"dd\[train\]: no column 'text' .*set data.messages_field"):
        texts(cfg(tmp_path / "dd"))


# ------------------------------------------------------------------ errors (one line each)


def one_line(excinfo):
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_missing_path(tmp_path):
    with pytest.raises(DataError) as e:
        texts(cfg(tmp_path / "nope.jsonl"))
    assert one_line(e) == f"{tmp_path / 'nope.jsonl'}: data path not found"


def test_broken_json_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"text": "ok"}, '{"text": "broken'])
    with pytest.raises(DataError) as e:
        texts(cfg(path))
    assert one_line(e).startswith(f"{path}:3: not valid JSON")


def test_non_object_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, "[1, 2]"])
    with pytest.raises(DataError, match=rf"{path}:2: expected a JSON object, got list"):
        texts(cfg(path))


def test_missing_field_names_file_line_and_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"txt": "typo"}])
    with pytest.raises(DataError) as e:
        texts(cfg(path))
    assert one_line(e) == f"{path}:2: missing field 'text'"
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=r"c.jsonl:1: missing field 'text' \(chat data\? set data.messages_field"):
        texts(cfg(path))


def test_wrong_type_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": None}])
    with pytest.raises(DataError, match=rf"{path}:1: field 'text' must be a string, got null"):
        texts(cfg(path))


def test_bad_messages(tmp_path, tiny_tokenizer):
    path = write_jsonl(
        tmp_path / "c.jsonl", [{"messages": CHAT}, {"messages": [{"role": "user"}]}, {"messages": "hi"}, {"m": []}]
    )
    c = cfg(path, messages_field="messages")
    with pytest.raises(DataError, match=rf"{path}:2: messages\[0\] is missing field 'content'"):
        texts(c, tiny_tokenizer)
    with pytest.raises(DataError, match="no tokenizer was given"):
        texts(c)
    path.write_text(json.dumps({"messages": "hi"}) + "\n" + json.dumps({"m": []}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: field 'messages' must be a non-empty list"):
        texts(c, tiny_tokenizer)
    path.write_text(json.dumps({"m": []}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: missing field 'messages'"):
        texts(c, tiny_tokenizer)


def test_parquet_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t.parquet: no column 'text' \(columns: body\)"):
        texts(cfg(tmp_path / "t.parquet"))
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n.parquet:row 2: field 'text' must be a string, got null"):
        texts(cfg(tmp_path / "n.parquet"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad.parquet: not a readable Parquet file"):
        texts(cfg(tmp_path / "bad.parquet"))


def test_text_folder_errors(tmp_path):
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(DataError, match=r"blob.bin: not UTF-8 text"):
        texts(cfg(tmp_path))
    with pytest.raises(DataError, match=r"no text files match data.text_glob '\*.rst'"):
        texts(cfg(tmp_path, text_glob="*.rst"))
    with pytest.raises(DataError, match="format 'saved' needs a folder"):
        texts(cfg(tmp_path / "ok.txt", format="saved"))
