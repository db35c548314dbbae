"""Training on chat data with data.train_on: assistant puts the loss on assistant tokens only."""
from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import torch

from sparsebalance_ft.data.chat import tokenize_chat
from sparsebalance_ft.recipe import load_recipe
from sparsebalance_ft.train.loop import train
from sparsebalance_ft.train.metrics import read_metrics


def _conversations(count=4):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8", errors="replace")[:400] for p in sorted(stdlib.glob("*.py"))[:count]]
    return [
        [
            {"role": "user", "content": f"Summarise this file:\n{text[:200]}"},
            {"role": "assistant", "content": text[200:300]},
            {"role": "user", "content": "And the rest?"},
            {"role": "assistant", "content": text[300:]},
        ]
        for text in texts
    ]


def test_first_step_loss_is_the_base_models_assistant_only_loss(write_recipe, tmp_path, tiny_tokenizer, tiny_model):
    conversations = _conversations()
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    recipe = load_recipe(write_recipe(
        data={"path": str(path), "messages_field": "messages", "train_on": "assistant"},
        training={"max_steps": 1, "docs_per_rank": len(conversations)},
    ))
    train(recipe)
    (row,) = read_metrics(Path(recipe.training.output_dir) / "metrics.jsonl")

    # the adapter starts as the identity (LoRA B = 0): step 1's loss is the base model's
    total, count = 0.0, 0
    with torch.no_grad():
        for messages in conversations:
            ids, mask = tokenize_chat(messages, tiny_tokenizer)
            ids = ids + [tiny_tokenizer.eos_token_id]  # the document's EOS, not an assistant token
            labels = [t if m else -100 for t, m in zip(ids, mask + [False])]
            n = sum(1 for label in labels[1:] if label != -100)
            loss = tiny_model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), use_cache=False).loss
            total, count = total + float(loss) * n, count + n
    assert 0 < count < sum(len(tokenize_chat(m, tiny_tokenizer)[0]) for m in conversations) // 2
    assert math.isclose(row["loss"], total / count, rel_tol=1e-4)
