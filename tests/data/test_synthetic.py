"""Synthetic passkey / key-value generators: the answer is where the record says it is."""
from __future__ import annotations

import json
import re

import pytest
import typer
from typer.testing import CliRunner

from sparsebalance_ft.data.synthetic import (
    KV_INTRO,
    PASSKEY_INTRO,
    PASSKEY_QUESTION,
    SyntheticError,
    generate,
    make_kv,
    make_passkey,
    write_jsonl,
)
from sparsebalance_ft.errors import UserError


def _check_passkey(record: dict) -> None:
    key = record["answer"]
    text = record["text"]
    assert re.fullmatch(r"\d{5}", key)
    assert text[record["needle_start"] : record["needle_end"]] == f"The pass key is {key}. Remember it. {key} is the pass key."
    assert text == record["prompt"] + f" {key}."
    assert record["prompt"].endswith(PASSKEY_QUESTION)
    assert text.count(key) == 3  # twice in the needle, once as the answer
    assert record["length"] <= record["target_length"]


def test_passkey_places_key_at_requested_depth():
    import random

    rng = random.Random(0)
    for depth in (0.0, 0.1, 0.33, 0.5, 0.9, 1.0):
        record = make_passkey(600, depth, rng)
        _check_passkey(record)
        units = record["filler_units"]
        assert abs(record["depth"] - depth) <= 0.5 / units + 1e-9
        # The achieved depth is exactly the share of filler sentences before the needle.
        before = record["text"][len(PASSKEY_INTRO) : record["needle_start"]]
        after = record["prompt"][record["needle_end"] : -len(PASSKEY_QUESTION)]
        n_before, n_after = before.count("."), after.count(".")
        assert n_before + n_after == units
        assert n_before / units == pytest.approx(record["depth"])


def test_passkey_depth_extremes():
    import random

    rng = random.Random(1)
    first = make_passkey(400, 0.0, rng)
    assert first["needle_start"] == len(PASSKEY_INTRO) + 1
    last = make_passkey(400, 1.0, rng)
    assert last["prompt"][last["needle_end"] :] == " " + PASSKEY_QUESTION


def test_passkey_exact_token_length_with_tokenizer(tiny_tokenizer):
    import random

    rng = random.Random(2)
    for target in (128, 300, 1000):
        record = make_passkey(target, 0.5, rng, tokenizer=tiny_tokenizer)
        _check_passkey(record)
        measured = len(tiny_tokenizer(record["text"], add_special_tokens=False)["input_ids"])
        assert measured == record["length"] <= target
        assert record["length"] >= target - 12  # one filler sentence is at most a dozen tokens
        assert record["length_unit"] == "tokens"
        prompt_fit = make_passkey(target, 0.5, rng, tokenizer=tiny_tokenizer, fit="prompt")
        assert target - 12 <= prompt_fit["prompt_length"] <= target


def test_kv_places_pair_at_requested_depth(tiny_tokenizer):
    import random

    rng = random.Random(3)
    for depth in (0.0, 0.5, 1.0):
        record = make_kv(400, depth, rng, tokenizer=tiny_tokenizer)
        text, key, value = record["text"], record["key"], record["answer"]
        assert text[record["needle_start"] : record["needle_end"]] == f'"{key}": "{value}"'
        body = text[len(KV_INTRO) - 1 : text.index("}") + 1]
        pairs = json.loads(body)
        assert pairs[key] == value
        keys = list(pairs)
        assert keys.index(key) == round(depth * (len(keys) - 1))
        assert record["prompt"].endswith(f'Key: "{key}"\nThe value is:')
        assert text == record["prompt"] + f' "{value}"'
        assert text.count(key) == 2
        assert record["length"] <= 400


def test_generate_is_deterministic_and_cycles_lengths():
    a = generate("passkey", [200, 400], 6, seed=7)
    b = generate("passkey", [200, 400], 6, seed=7)
    c = generate("passkey", [200, 400], 6, seed=8)
    assert a == b
    assert [r["answer"] for r in a] != [r["answer"] for r in c]
    assert [r["target_length"] for r in a] == [200, 400] * 3
    grid = generate("kv", [200], 4, seed=0, depths=[0.0, 1.0])
    assert [r["target_depth"] for r in grid] == [0.0, 1.0, 0.0, 1.0]
    assert len({r["id"] for r in a}) == 6


def test_generator_errors_are_user_errors():
    with pytest.raises(SyntheticError, match="unknown synthetic task"):
        generate("nope", [200], 1)
    with pytest.raises(UserError, match="too short"):
        generate("passkey", [40], 1)
    with pytest.raises(UserError, match="depth"):
        generate("kv", [200], 1, depths=[1.5])


def test_write_jsonl_roundtrip(tmp_path):
    records = generate("kv", [150], 3, seed=1)
    path = tmp_path / "sub" / "kv.jsonl"
    assert write_jsonl(records, path) == 3
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["text"] for r in lines] == [r["text"] for r in records]


def test_synth_cli(tmp_path, tiny_model_dir):
    from sbft_cli import synth

    app = typer.Typer()
    synth.register(app)

    @app.command("noop")
    def _noop() -> None:  # a second command keeps `synth` a named subcommand
        pass

    out = tmp_path / "pk.jsonl"
    result = CliRunner().invoke(
        app,
        ["synth", "passkey", "--out", str(out), "--lengths", "200,300", "--count", "4", "--depths", "0,100",
         "--tokenizer", str(tiny_model_dir)],
    )
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4 and all(r["length"] <= r["target_length"] for r in records)
    assert [r["target_depth"] for r in records] == [0.0, 1.0, 0.0, 1.0]

    bad = CliRunner().invoke(app, ["synth", "passkey", "--out", str(out), "--lengths", "20"])
    assert bad.exit_code == 2
    assert "too short" in bad.output
