"""Shared fixtures for every test: a tiny model built locally, a small real-text corpus.

Everything here is session-scoped and cheap (the tiny model and its tokenizer take about a
second to build); tests that change files must copy them first (`tmp_path`).

- `tiny_model_dir`: a tiny Llama (hidden 128, 4 layers, 4 heads / 2 KV heads, vocab 4096) and
  its tokenizer, written by `init_tiny`; load with `AutoModelForCausalLM.from_pretrained`.
- `tiny_tokenizer`: that tokenizer, loaded once (do not mutate it).
- `tiny_model`: a fresh float32 model in eval mode per test (loading is ~0.1 s).
- `text_corpus_dir`: a folder of real text files (Python standard library sources), 24 files of
  varied length (roughly 40 to 5000 tokens each).
- `jsonl_corpus`: the same texts as a JSONL file with a `text` field.
- `data_config`: a factory `data_config(**overrides) -> DataConfig` over `text_corpus_dir`, with
  its cache in a fresh temporary folder.
- `write_recipe`: a factory `write_recipe(**sections) -> Path` of a small, fast training recipe
  (the tiny model over `jsonl_corpus`); keyword sections update its defaults.
- `free_port`: a function returning a TCP port free on 127.0.0.1 now (the rendezvous of two gloo ranks).
"""
from __future__ import annotations

import json
import os
import socket
import sysconfig
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def _corpus_texts(count: int = 24) -> list[tuple[str, str]]:
    """Deterministic real texts of varied length: every 5th top-level stdlib module, cut at a length that varies."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file() and p.stat().st_size > 2000)
    texts = []
    for i, path in enumerate(files[::5][:count]):
        text = path.read_text(encoding="utf-8", errors="replace")
        cut = [300, 1500, 4000, 12000][i % 4]
        texts.append((path.stem, text[:cut]))
    return texts


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from sparsebalance_ft.modeling.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def tiny_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def text_corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus") / "texts"
    root.mkdir()
    for i, (name, text) in enumerate(_corpus_texts()):
        (root / f"{i:02d}_{name}.txt").write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def jsonl_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus_jsonl") / "texts.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for name, text in _corpus_texts():
            f.write(json.dumps({"text": text, "source": name}) + "\n")
    return path


@pytest.fixture
def data_config(text_corpus_dir, tmp_path):
    from sparsebalance_ft.recipe import DataConfig

    def make(**overrides) -> DataConfig:
        values = {"path": str(text_corpus_dir), "cache_dir": str(tmp_path / "sbft_cache"), "max_seq_len": 2048}
        values.update(overrides)
        return DataConfig(**values)

    return make


@pytest.fixture
def write_recipe(tiny_model_dir, jsonl_corpus, tmp_path):
    """`write_recipe(**sections) -> Path`: a small, fast training recipe; keyword sections update the defaults."""

    def make(**sections) -> Path:
        recipe = {
            # dense attention and one-step random batching: fast, and what most tests are not about
            "model": {"path": str(tiny_model_dir), "attn_implementation": "sdpa"},
            "balance": {"batching": "random"},
            "lora": {"r": 8, "alpha": 16},
            "data": {"path": str(jsonl_corpus), "max_seq_len": 512, "cache_dir": str(tmp_path / "cache")},
            "training": {
                "output_dir": str(tmp_path / "run"),
                "max_steps": 6,
                "docs_per_rank": 2,
                "learning_rate": 3e-3,
                "lr_scheduler": "constant",
                "tensorboard": False,
            },
        }
        for name, values in sections.items():
            recipe.setdefault(name, {}).update(values)
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe))
        return path

    return make


@pytest.fixture
def free_port():
    def pick() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    return pick
