import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparsebalance_ft.errors import UserError
from sparsebalance_ft.modeling.tiny import init_tiny


def test_tiny_loads_through_from_pretrained(tiny_model_dir, tiny_tokenizer, tiny_model):
    cfg = tiny_model.config
    assert cfg.model_type == "llama"
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 32)
    assert cfg.max_position_embeddings == 65536
    assert cfg.vocab_size == len(tiny_tokenizer)
    tok = tiny_tokenizer
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "def add(a, b):\n    return a + b  # 42 héllo\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert ids[0] != tok.bos_token_id and ids[-1] != tok.eos_token_id  # the data pipeline adds EOS itself
    out = tiny_model(torch.tensor([ids]))
    assert out.logits.shape == (1, len(ids), cfg.vocab_size)
    assert torch.isfinite(out.logits).all()


def test_chat_template(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], tokenize=False
    )
    assert text == "<|bos|><|user|>\nhi<|eos|>\n<|assistant|>\nhello<|eos|>\n"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tiny_tokenizer.bos_token_id and ids.count(tiny_tokenizer.eos_token_id) == 2


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families_tokenize_identically(tmp_path, family, tiny_tokenizer):
    out = init_tiny(tmp_path / family, family=family, hidden_size=64, layers=1, heads=2, kv_heads=1)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == family
    text = "for i in range(10):\n    print(i)\n"
    assert tok(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]
    assert len(tok) == model.config.vocab_size
    assert model(torch.tensor([tok(text)["input_ids"]])).logits.shape[-1] == len(tok)


def test_deterministic(tmp_path, tiny_model_dir):
    again = init_tiny(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    assert json.loads((again / "sbft_tiny.json").read_text())["family"] == "llama"


def test_text_source_and_bad_arguments(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world, hello tokenizer. " * 200)
    out = init_tiny(tmp_path / "m", vocab_size=320, hidden_size=32, layers=1, heads=2, kv_heads=1, text_source=text)
    assert len(AutoTokenizer.from_pretrained(out)) <= 320
    with pytest.raises(UserError, match="family 'gpt2'"):
        init_tiny(tmp_path / "x", family="gpt2")
    with pytest.raises(UserError, match="not a multiple"):
        init_tiny(tmp_path / "x", heads=3)
    with pytest.raises(UserError, match="not found"):
        init_tiny(tmp_path / "x", text_source=tmp_path / "missing.txt")
