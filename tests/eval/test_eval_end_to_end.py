"""`sbft eval` end to end on the tiny random model: it runs and writes its results (accuracy may be 0)."""
from __future__ import annotations

import json

import pytest

from sparsebalance_ft.eval.api import evaluate, resolve_checkpoint
from sparsebalance_ft.eval.errors import EvalOptionError


def test_passkey_cli_writes_json_predictions_heatmap(cli, eval_recipe_path, adapter_dir, tmp_path):
    out = tmp_path / "out"
    result = cli(
        "eval", eval_recipe_path, "--task", "passkey", "--checkpoint", adapter_dir,
        "--lengths", "128,256", "--depths", "0,100", "--samples", "1", "--out", out, "--batch-size", "2",
    )
    assert result.exit_code == 0, result.output
    data = json.loads((out / "passkey_dense.json").read_text())
    assert data["task"] == "passkey" and data["attention"] == "dense"
    assert data["n"] == 4 and 0.0 <= data["accuracy"] <= 1.0
    assert set(data["by_length"]) == {"128", "256"}
    assert data["grid"]["cols"] == [128, 256] and data["grid"]["rows"] == [0.0, 1.0]
    assert data["checkpoint"] == str(adapter_dir) and data["mean_recall"] is None
    predictions = (out / "passkey_dense_predictions.jsonl").read_text().splitlines()
    assert len(predictions) == 4 and "prediction" in json.loads(predictions[0])
    assert (out / "passkey_dense_heatmap.png").stat().st_size > 1000
    assert "passkey accuracy" in result.output


def test_needle_cli(cli, eval_recipe_path, text_corpus_dir, tmp_path):
    out = tmp_path / "needle"
    result = cli(
        "eval", eval_recipe_path, "--task", "needle", "--haystack", text_corpus_dir,
        "--lengths", "200", "--depths", "0,0.5,1", "--out", out, "--max-new-tokens", "4",
    )
    assert result.exit_code == 0, result.output
    data = json.loads((out / "needle_dense.json").read_text())
    assert data["n"] == 3 and data["grid"]["rows"] == [0.0, 0.5, 1.0]
    assert (out / "needle_dense_heatmap.png").is_file()


def _longbench_rows():
    base = {"context": "The capital of France is Paris. " * 30, "input": "What is the capital of France?", "length": 180}
    return [
        {**base, "answers": ["Paris"], "dataset": "hotpotqa"},
        {**base, "answers": ["Paris is the capital."], "dataset": "gov_report"},
        {**base, "context": "def f(x):\n    y = x\n", "input": "", "answers": ["return y"], "dataset": "lcc"},
    ]


def test_longbench_cli(cli, eval_recipe_path, tmp_path):
    data_file = tmp_path / "lb.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in _longbench_rows()))
    out = tmp_path / "lb"
    result = cli("eval", eval_recipe_path, "--task", "longbench", "--data", data_file, "--out", out, "--max-new-tokens", "6")
    assert result.exit_code == 0, result.output
    data = json.loads((out / "longbench_dense.json").read_text())
    assert set(data["datasets"]) == {"hotpotqa", "gov_report", "lcc"}
    assert data["datasets"]["lcc"]["metric"] == "code_sim"
    assert all(0.0 <= d["score"] <= 100.0 for d in data["datasets"].values())


def test_cli_errors_are_one_line_exit_2(cli, eval_recipe_path, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_longbench_rows()[0]) + "\n{oops\n")
    result = cli("eval", eval_recipe_path, "--task", "longbench", "--data", bad)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip() and "Loading weights" not in line]
    assert lines[-1].startswith("error: ") and f"{bad}:2:" in "".join(lines).replace("\n", "")

    missing = cli("eval", eval_recipe_path, "--task", "longbench", "--data", tmp_path / "nope.jsonl")
    assert missing.exit_code == 2 and "nope.jsonl" in missing.output and "not found" in missing.output

    for args, message in (
        (("--task", "bogus"), "unknown task"),
        (("--task", "passkey", "--attention", "half"), "--attention"),
        (("--task", "passkey", "--checkpoint", tmp_path), "holds no LoRA adapter"),
        (("--task", "passkey", "--lengths", "100000"), "exceeds the model's context"),
        (("--task", "needle", "--haystack", tmp_path / "nowhere", "--lengths", "128"), "haystack path not found"),
    ):
        result = cli("eval", eval_recipe_path, *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output.replace("\n", ""), (args, result.output)

    missing_recipe = cli("eval", tmp_path / "absent.yaml", "--task", "passkey")
    assert missing_recipe.exit_code == 2


def test_checkpoint_kinds(tmp_path, adapter_dir, tiny_model_dir, eval_recipe):
    import shutil

    import torch

    from sparsebalance_ft.train.checkpoint import trainable_state
    from sparsebalance_ft.train.model import load_model

    assert resolve_checkpoint(adapter_dir) == ("adapter", adapter_dir)
    run = tmp_path / "run"
    shutil.copytree(adapter_dir, run / "adapter")
    assert resolve_checkpoint(run) == ("adapter", run / "adapter")
    assert resolve_checkpoint(tiny_model_dir) == ("full", tiny_model_dir)
    with pytest.raises(EvalOptionError):
        resolve_checkpoint(tmp_path / "missing")

    # A training checkpoint (trainable weights only) loads into a fresh adapter from the recipe.
    model, _ = load_model(eval_recipe)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    ckpt = tmp_path / "out" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    torch.save(trainable_state(model), ckpt / "trainable_weights.pt")
    (ckpt / "COMPLETE").write_text("3\n")
    assert resolve_checkpoint(tmp_path / "out") == ("trainable", ckpt)

    from sparsebalance_ft.eval.api import load_for_eval

    loaded, _, controller = load_for_eval(eval_recipe, tmp_path / "out")
    assert controller is None
    expected = dict(model.merge_and_unload().named_parameters())
    got = dict(loaded.named_parameters())
    names = [n for n in got if n.endswith("q_proj.weight")]
    assert names
    for name in names:
        assert torch.allclose(got[name], expected[name])
    fresh, _, _ = load_for_eval(eval_recipe, None)  # the base model: no LoRA delta
    assert not torch.allclose(dict(fresh.named_parameters())[names[0]], got[names[0]])


def test_evaluate_api_without_writing(eval_recipe):
    result = evaluate(eval_recipe, "kv", lengths=[160], depths=[0.5], samples=2, out_dir=None, show_progress=False)
    assert result["n"] == 2 and "files" not in result and result["context"] == 512


def test_sparse_attention_reports_recall(eval_recipe, tmp_path):
    from sparsebalance_ft.attention import SparsityConfig

    sparsity = SparsityConfig(block_size=16, k_min=1, k_max=4, local_blocks=1, budget=0.5)
    recipe = eval_recipe.model_copy(update={"sparsity": sparsity})
    result = evaluate(
        recipe, "passkey", attention="sparse", lengths=[512], depths=[0.0, 1.0], samples=1,
        out_dir=tmp_path, show_progress=False, budget=0.3,
    )
    assert result["attention"] == "sparse" and result["budget"] == 0.3
    assert result["mean_recall"] is not None and 0.0 <= result["mean_recall"] <= 1.0 + 1e-6
    assert result["mean_density"] is not None and result["mean_density"] < 1.0
    assert (tmp_path / "passkey_sparse.json").is_file()


def test_nproc_relaunches_with_the_same_options(cli, eval_recipe_path, tmp_path, monkeypatch):
    import sparsebalance_ft.train.launch as launch

    calls = []
    monkeypatch.setattr(launch, "launch_ranks", lambda nproc, argv, module="sbft_cli.app": calls.append((nproc, argv)))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    result = cli(
        "eval", eval_recipe_path, "--task", "needle", "--nproc", "2", "--lengths", "128,256", "--depths", "0,50",
        "--haystack", tmp_path, "--set", "data.max_seq_len=300", "--budget", "0.4", "--out", tmp_path / "o",
    )
    assert result.exit_code == 0, result.output
    nproc, argv = calls[0]
    assert nproc == 2 and argv[:2] == ["eval", str(eval_recipe_path)] and "--nproc" not in argv
    for expected in ("--lengths=128,256", "--depths=0,50", f"--haystack={tmp_path}", "--set=data.max_seq_len=300"):
        assert expected in argv
    assert argv[argv.index("--budget") + 1] == "0.4" and argv[argv.index("--out") + 1] == str(tmp_path / "o")


def test_answer_nll_matches_a_manual_forward(tiny_model, tiny_tokenizer):
    import torch

    from sparsebalance_ft.eval.engine import answer_nll

    prompts = [tiny_tokenizer("The pass key is 123. What is the pass key? The pass key is")["input_ids"],
               tiny_tokenizer("Short prompt, the key is")["input_ids"]]
    continuations = [" 123", " 98765"]
    batched = answer_nll(tiny_model, tiny_tokenizer, prompts, continuations, batch_size=2, allow_padding=True)
    single = answer_nll(tiny_model, tiny_tokenizer, prompts, continuations, batch_size=1)
    assert batched == pytest.approx(single, abs=1e-4)
    answer = tiny_tokenizer(" 123", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([list(prompts[0]) + answer])
    with torch.no_grad():
        logprobs = torch.log_softmax(tiny_model(input_ids=ids).logits.float(), -1)[0]
    n, k = ids.shape[1], len(answer)
    manual = -sum(logprobs[n - k - 1 + j, answer[j]].item() for j in range(k)) / k
    assert single[0] == pytest.approx(manual, abs=1e-4)


def test_evaluate_reports_answer_nll(eval_recipe):
    result = evaluate(eval_recipe, "passkey", lengths=[128], depths=[0.0, 1.0], samples=1, answer_nll=True, show_progress=False)
    assert result["answer_nll"] > 0 and set(result["answer_nll_by_length"]) == {"128"}
    plain = evaluate(eval_recipe, "passkey", lengths=[128], depths=[0.0], samples=1, show_progress=False)
    assert plain["answer_nll"] is None
