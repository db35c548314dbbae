"""Hub dataset ids for data.path: loaded with datasets.load_dataset when online, one line naming the id offline."""
import os
import subprocess
import sys

import pytest
import yaml

from sparsebalance_ft.data import sources
from sparsebalance_ft.data.corpus import load_corpus
from sparsebalance_ft.data.sources import DataError, detect_format, read_documents
from sparsebalance_ft.hub import is_hub_id
from sparsebalance_ft.recipe import DataConfig


def test_what_reads_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("roneneldan/TinyStories") and is_hub_id("HuggingFaceFW/fineweb-edu")
    assert not is_hub_id("data/train.jsonl")  # a data file's name: a missing local file
    assert not is_hub_id("/abs/path") and not is_hub_id("one-part") and not is_hub_id("a/b/c")
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "name").write_text("local text")
    assert not is_hub_id("owner/name")  # a local path wins
    with pytest.raises(DataError, match="^data/train.jsonl: data path not found$"):
        detect_format(DataConfig(path="data/train.jsonl"))


@pytest.fixture
def fake_hub(monkeypatch):
    """datasets.load_dataset answering for one id with a local DatasetDict (the network is not reachable here)."""
    import datasets

    loaded = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": [f"training document {i} " * 20 for i in range(5)]}),
        "test": datasets.Dataset.from_dict({"text": ["a test document " * 20]}),
    })
    calls = []

    def load_dataset(name, *args, **kwargs):
        calls.append(name)
        if name != "someone/stories":
            raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")
        return loaded

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    sources.load_hub_dataset.cache_clear()
    yield calls
    sources.load_hub_dataset.cache_clear()


def test_a_hub_id_reads_its_train_split(fake_hub, tmp_path, tiny_tokenizer):
    cfg = DataConfig(path="someone/stories", cache_dir=str(tmp_path / "c"))
    assert detect_format(cfg) == "hub"
    docs = list(read_documents(cfg))
    assert [d.where for d in docs][:2] == ["someone/stories[train]:row 1", "someone/stories[train]:row 2"]
    assert docs[4].text == "training document 4 " * 20
    corpus = load_corpus(cfg, tiny_tokenizer)
    assert len(corpus) == 5 and not corpus.summary()["cache_hit"]
    assert load_corpus(cfg, tiny_tokenizer).summary()["cache_hit"]
    assert fake_hub == ["someone/stories"]  # loaded once per process


def test_an_unloadable_hub_id_is_one_line_naming_it(fake_hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    with pytest.raises(DataError, match=r"^someone/missing: not a local path; as a Hugging Face Hub dataset id it could"
                                        r" not be loaded: Dataset 'someone/missing' doesn't exist on the Hub$"):
        list(read_documents(DataConfig(path="someone/missing")))


def test_offline_train_on_a_hub_id_exits_2_with_one_line(write_recipe, tmp_path):
    """The real datasets.load_dataset, offline (the test environment sets HF_DATASETS_OFFLINE=1)."""
    recipe = yaml.safe_load(write_recipe().read_text())
    recipe["data"]["path"] = "nobody-here/no-such-dataset"
    path = tmp_path / "hub.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "sbft_cli.app", "train", str(path)], capture_output=True, text=True,
                            timeout=300, env=env)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "nobody-here/no-such-dataset: not a local path; as a Hugging Face Hub dataset id it could not be loaded:" in lines[0]
    assert "offline" in lines[0]


def test_offline_runs_never_reach_for_hub_kernels(monkeypatch):
    from sparsebalance_ft.hub import no_hub_kernels_offline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    no_hub_kernels_offline()
    assert os.environ["USE_HUB_KERNELS"] == "NO"
    monkeypatch.setenv("USE_HUB_KERNELS", "YES")  # the user's own choice stands
    no_hub_kernels_offline()
    assert os.environ["USE_HUB_KERNELS"] == "YES"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("USE_HUB_KERNELS")
    no_hub_kernels_offline()
    assert "USE_HUB_KERNELS" not in os.environ
