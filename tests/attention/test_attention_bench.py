"""The attention benchmark and its CLI command, on tiny shapes."""
from __future__ import annotations

import json

import pytest
import torch
import typer
from typer.testing import CliRunner

from sparsebalance_ft.bench.attention import run_attention_bench
from sparsebalance_ft.train.model import enable_checkpointing


def test_run_attention_bench_rows():
    res = run_attention_bench(lengths=[256], densities=[0.3, 1.0], repeats=1, heads=4, kv_heads=2, head_dim=16,
                              kernel_at_full=True, warmup=False)
    rows = res["rows"]
    assert [r["route"] for r in rows] == ["sparse-torch", "dense-sdpa", "full-kernel"]
    for r in rows:
        assert r["sparse_s"] > 0 and r["dense_s"] > 0 and r["speedup"] > 0
        assert 0 <= r["selection_share"] <= 1
        assert r["ideal_speedup"] == pytest.approx(1 / r["density"])
    assert res["setup"]["kv_heads"] == 2


def test_bench_cli_writes_json(tmp_path):
    from sbft_cli.bench import register

    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:  # a group, so that `bench` is a subcommand
        pass

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "attention", "--lengths", "256", "--densities", "0.5,1",
                                      "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 2
    bad = CliRunner().invoke(app, ["bench", "attention", "--densities", "0,2"])
    assert bad.exit_code == 2


def test_gradient_checkpointing_recompute_is_not_counted(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from sparsebalance_ft.attention import SparseAttentionController, SparsityConfig, register_sparse_attention

    register_sparse_attention()
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sparsebalance")
    enable_checkpointing(model)
    model.train()
    ctl = SparseAttentionController.attach(model, SparsityConfig(block_size=16, k_min=1, k_max=2))
    ids = torch.randint(0, 64, (1, 96))
    model(input_ids=ids, labels=ids).loss.backward()
    rep = ctl.pop_report()
    assert rep.forwards == 1 and len(rep.doc_densities) == 1


def test_cpu_clock_counts_this_process_work_only(monkeypatch):
    """--clock cpu reads process CPU time: a sleep inside the timed call (time lost to other jobs) adds nothing.
    The sleep is long against the call's own CPU cost, which a first call's set-up can bring to half a second."""
    import time

    import sparsebalance_ft.bench.attention as bench

    sdpa = bench.F.scaled_dot_product_attention

    def slow_sdpa(*args, **kwargs):
        time.sleep(3.0)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(bench.F, "scaled_dot_product_attention", slow_sdpa)
    common = dict(lengths=[128], densities=[1.0], repeats=1, heads=2, kv_heads=1, head_dim=16, warmup=False)
    wall, cpu = run_attention_bench(**common)["rows"][0], run_attention_bench(**common, clock="cpu")["rows"][0]
    assert wall["dense_s"] >= 3.0 and cpu["dense_s"] < 1.5
