"""The recipe schema: round trip, overrides, and one clear line for every kind of mistake."""
from pathlib import Path

import pytest
import yaml

from sparsebalance_ft.recipe import RecipeError, describe_setup, dump_recipe, load_recipe


@pytest.fixture
def paths(tmp_path: Path) -> dict:
    model = tmp_path / "model"
    model.mkdir()
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    return {"model": str(model), "data": str(data), "root": tmp_path}


def write(tmp_path: Path, content) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return path


def minimal(paths: dict) -> dict:
    return {"model": {"path": paths["model"]}, "data": {"path": paths["data"], "max_seq_len": 256}}


def test_round_trip_keeps_every_value(paths):
    recipe = load_recipe(write(paths["root"], minimal(paths)))
    dumped = paths["root"] / "again.yaml"
    dump_recipe(recipe, dumped)
    again = load_recipe(dumped)
    assert again == recipe
    assert again.fingerprint() == recipe.fingerprint()


def test_overrides_are_typed_and_nested(paths):
    recipe = load_recipe(
        write(paths["root"], minimal(paths)),
        [
            "training.max_steps=7",
            "lora.target_modules=[q_proj,v_proj]",
            "sparsity.budget=0.25",
            "model.attn_implementation=sparsebalance",
            "balance.tuning=bidirectional",
        ],
    )
    assert recipe.training.max_steps == 7
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert recipe.sparsity.budget == 0.25
    assert recipe.balance.tuning == "bidirectional"


def test_fingerprint_changes_with_content(paths):
    path = write(paths["root"], minimal(paths))
    assert load_recipe(path).fingerprint() != load_recipe(path, ["training.seed=1"]).fingerprint()


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda r: r["training"].update(bogus=1), "training.bogus: unknown key"),
        (lambda r: r.update(extra_section={}), "extra_section: unknown key"),
        (lambda r: r["training"].update(max_steps="many"), "training.max_steps: Input should be a valid integer"),
        (lambda r: r["training"].update(max_steps=0), "training.max_steps: Input should be greater than or equal to 1"),
        (lambda r: r["model"].update(attn_implementation="magic"), "model.attn_implementation: Input should be"),
        (lambda r: r["model"].pop("path"), "model.path: required key is missing"),
        (lambda r: r.pop("data"), "data: required key is missing"),
        (lambda r: r["data"].update(too_long="explode"), "data.too_long: Input should be"),
        (lambda r: r["sparsity"].update(k_min=9, k_max=3), "k_min (9) must not exceed k_max (3)"),
        (lambda r: r["sparsity"].update(block_size=48), "block_size must be a power of two"),
        (lambda r: r["balance"].update(min_budget=0.8, max_budget=0.2), "min_budget (0.8) must not exceed max_budget"),
        (lambda r: r["balance"].update(batching="magic"), "balance.batching: Input should be"),
        (lambda r: r["training"].update(micro_batch_tokens=100), "micro_batch_tokens (100) is below data.max_seq_len"),
    ],
)
def test_schema_errors_name_the_key(paths, mutate, expected):
    recipe = minimal(paths)
    recipe.update(training={}, sparsity={}, balance={})
    mutate(recipe)
    with pytest.raises(RecipeError) as info:
        load_recipe(write(paths["root"], recipe))
    message = str(info.value)
    assert expected in message
    assert "\n" not in message
    assert message.startswith(str(paths["root"] / "recipe.yaml"))


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_invalid_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "model:\n  path: x\ndata: [unclosed\n")
    with pytest.raises(RecipeError, match=r"recipe.yaml:\d+: not valid YAML"):
        load_recipe(path)


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(RecipeError, match="expected a mapping"):
        load_recipe(write(tmp_path, "- a\n- b\n"))


@pytest.mark.parametrize("key", ["model.path", "data.path", "data.tokenizer", "balance.profile"])
def test_missing_paths_name_the_key(paths, key):
    with pytest.raises(RecipeError, match=f"{key}: path not found"):
        load_recipe(write(paths["root"], minimal(paths)), [f"{key}={paths['root'] / 'absent'}"])


@pytest.mark.parametrize("item", ["no_equals_sign", "=3"])
def test_malformed_override(paths, item):
    with pytest.raises(RecipeError, match="expected KEY=VALUE"):
        load_recipe(write(paths["root"], minimal(paths)), [item])


def test_override_through_a_scalar_is_refused(paths):
    with pytest.raises(RecipeError, match="'max_steps' is not a section"):
        load_recipe(write(paths["root"], minimal(paths)), ["training.max_steps=3", "training.max_steps.x=1"])


def test_shipped_recipes_validate():
    for path in sorted(Path(__file__).parents[1].glob("recipes/*.yaml")):
        load_recipe(path, check_paths=False)


def test_an_explicit_tuning_needs_the_sparse_attention(paths):
    with pytest.raises(RecipeError, match="needs model.attn_implementation: sparsebalance"):
        load_recipe(write(paths["root"], minimal(paths)), ["model.attn_implementation=sdpa", "balance.tuning=bidirectional"])


def test_the_defaults_are_the_recommended_setup(paths):
    """Only model and data: sparse attention, SparseBalance batching, layer tuning filling to the slowest rank."""
    recipe = load_recipe(write(paths["root"], {"model": {"path": paths["model"]}, "data": {"path": paths["data"]}}))
    assert recipe.model.attn_implementation == "sparsebalance"
    assert (recipe.balance.batching, recipe.balance.tuning, recipe.balance.target) == ("sparsebalance", "layer", "fill")
    assert recipe.uses_gradient_checkpointing  # the default 4,096 tokens is long
    assert describe_setup(recipe)[1] == "changed from the defaults: none"


@pytest.mark.parametrize(("tokens", "expected"), [(2048, False), (4095, False), (4096, True), (32768, True)])
def test_gradient_checkpointing_auto_follows_the_sequence_length(paths, tokens, expected):
    recipe = load_recipe(write(paths["root"], minimal(paths)), [f"data.max_seq_len={tokens}"])
    assert recipe.uses_gradient_checkpointing is expected
    forced = load_recipe(write(paths["root"], minimal(paths)), [f"data.max_seq_len={tokens}", "model.gradient_checkpointing=false"])
    assert forced.uses_gradient_checkpointing is False


def test_a_nested_setting_is_shown_by_the_keys_set(paths):
    recipe = load_recipe(write(paths["root"], minimal(paths)), ["model.rope_scaling.type=yarn"])
    assert "model.rope_scaling={'type': 'yarn', 'factor': 'auto'}," in describe_setup(recipe)[1]


def test_the_dense_baseline_is_one_switch(paths):
    """`model.attn_implementation=sdpa` alone validates: the default tuning steps aside (nothing to tune)."""
    recipe = load_recipe(write(paths["root"], minimal(paths)), ["model.attn_implementation=sdpa"])
    assert recipe.balance.tuning == "none"
    setup, changed = describe_setup(recipe)
    assert setup.startswith("setup: dense attention (sdpa), batching sparsebalance, tuning off")
    assert changed == "changed from the defaults: model.attn_implementation=sdpa, data.max_seq_len=256, balance.tuning=none"
    again = load_recipe(write(paths["root"], recipe.model_dump(mode="json")))  # the dumped run recipe reloads as is
    assert again == recipe


def test_layer_tuning_by_default_names_the_way_to_budget_one(paths):
    with pytest.raises(RecipeError, match=r"tuning 'layer' \(the default; bidirectional tunes up to 1.0\) needs max_budget < 1.0"):
        load_recipe(write(paths["root"], minimal(paths)), ["balance.max_budget=1.0"])
    load_recipe(write(paths["root"], minimal(paths)), ["balance.max_budget=1.0", "balance.tuning=bidirectional"])


def test_default_budget_must_lie_within_the_tuning_bounds(paths):
    with pytest.raises(RecipeError, match=r"sparsity.budget \(0.95\) lies outside"):
        load_recipe(
            write(paths["root"], minimal(paths)),
            ["model.attn_implementation=sparsebalance", "balance.tuning=bidirectional", "sparsity.budget=0.95"],
        )


@pytest.mark.parametrize("value", ["none", "[none]", "[]", "null"])
def test_report_to_none_in_every_spelling_means_no_tracker(paths, value):
    recipe = load_recipe(write(paths["root"], minimal(paths)), [f"training.report_to={value}"])
    assert recipe.training.report_to == []
