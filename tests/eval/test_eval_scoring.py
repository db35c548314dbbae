"""`sbft eval`'s scoring end to end (prompts built, continuations generated and cut, decoded, scored and
summarised) on models whose answers are known: one that reads the key back scores 100%, one that answers
another number scores 0%. The tiny random model cannot tell a scorer that always passes from one that works."""
from __future__ import annotations

import re

import torch

from sparsebalance_ft.eval.api import evaluate

NEEDLE = re.compile(r"The pass key is (\d+)\. Remember it\.")


class PromptReader(torch.nn.Module):
    """A stand-in model that answers a passkey prompt by reading it: the key itself, or the key plus one."""

    def __init__(self, tokenizer, wrong: bool):
        super().__init__()
        self.tokenizer, self.wrong = tokenizer, wrong
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the engine reads the device off a parameter

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, **_):
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            key = int(NEEDLE.findall(self.tokenizer.decode(ids[mask.bool()].tolist()))[0])
            answer = self.tokenizer(f" {key + 1 if self.wrong else key}.", add_special_tokens=False).input_ids
            new = (answer + [eos_token_id] * max_new_tokens)[:max_new_tokens]
            rows.append(torch.cat([ids, torch.tensor(new, dtype=ids.dtype)]))
        return torch.stack(rows)


def _passkey(eval_recipe, tiny_tokenizer, wrong: bool) -> dict:
    model = PromptReader(tiny_tokenizer, wrong)
    return evaluate(eval_recipe, "passkey", lengths=[128, 256], depths=[0.0, 0.5, 1.0], samples=2, out_dir=None,
                    show_progress=False, loaded=(model, tiny_tokenizer, None), batch_size=3)


def test_a_model_that_reads_the_key_back_scores_every_prompt(eval_recipe, tiny_tokenizer):
    result = _passkey(eval_recipe, tiny_tokenizer, wrong=False)
    assert result["n"] == 12 and result["accuracy"] == 1.0
    assert all(value == 1.0 for value in result["by_length"].values())


def test_a_model_that_answers_another_number_scores_none(eval_recipe, tiny_tokenizer):
    result = _passkey(eval_recipe, tiny_tokenizer, wrong=True)
    assert result["n"] == 12 and result["accuracy"] == 0.0
