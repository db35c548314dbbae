"""model.path as a hub id: accepted by the recipe, and offline one line naming the id."""
import pytest
import yaml

from sparsebalance_ft.hub import hub_failure, is_hub_id
from sparsebalance_ft.recipe import load_recipe
from sparsebalance_ft.train.model import ModelLoadError, load_base_model, load_tokenizer


@pytest.mark.parametrize("value, expected", [
    ("HuggingFaceTB/SmolLM2-135M", True), ("org/model.v2", True), ("/abs/path", False), ("./rel/x", False),
    ("a/b/c", False), ("plainname", False),
])
def test_is_hub_id(value, expected):
    assert is_hub_id(value) is expected


def test_an_existing_folder_is_never_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/model")


def test_offline_hub_id_fails_in_one_line_naming_it(tmp_path, monkeypatch, text_corpus_dir):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "someorg/some-model"}, "data": {"path": str(text_corpus_dir)}}))
    recipe = load_recipe(path)  # the recipe accepts it: no local path to check
    for load in (load_tokenizer, load_base_model):
        with pytest.raises(ModelLoadError) as caught:
            load(recipe)
        message = str(caught.value)
        assert "\n" not in message and "someorg/some-model" in message and "HF_HUB_OFFLINE is set" in message


def test_failure_names_the_connection_error_when_online(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    line = hub_failure("model.path", "o/m", OSError("We couldn't connect to 'https://huggingface.co'\nmore"))
    assert line == "model.path: o/m is not a local folder and cannot be loaded from the Hugging Face hub " \
                   "(We couldn't connect to 'https://huggingface.co')"
