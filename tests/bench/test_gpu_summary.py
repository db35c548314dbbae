"""`make gpu-check`'s closing JSON names each benchmark file and keeps the figures compared first."""
import json

from sparsebalance_ft.bench.gpu_summary import summarize


def test_summary_keeps_each_files_headline(tmp_path):
    attention = {"setup": {"device": "cuda"}, "rows": [
        {"length": 32768, "density": 0.0625, "route": "sparse-flex", "speedup": 3.5, "share_of_ideal": 0.22,
         "selection_share": 0.1, "sparse_s": 0.01, "dense_s": 0.035}]}
    step = {"setup": {"device": "cuda", "gpu": "NVIDIA H200"}, "rows": [
        {"length": 65536, "arm": "0.5", "step_s": 3.6, "speedup_vs_dense": 0.6, "amdahl_ceiling": 2.63,
         "loss_gap": -0.04, "kept_density": 0.084, "attention_share": 0.68, "selection_share_of_attention": 0.79,
         "host_syncs_per_step": 314, "spans": {"selection": 2.3}}]}
    (tmp_path / "attention-flex.json").write_text(json.dumps(attention))
    (tmp_path / "step-triton.json").write_text(json.dumps(step))
    (tmp_path / "unrelated.json").write_text("{}")
    summary = summarize(tmp_path)
    assert set(summary) == {"folder", "attention-flex.json", "step-triton.json"}
    assert summary["attention-flex.json"]["rows"] == [{"length": 32768, "density": 0.0625, "route": "sparse-flex",
                                                       "speedup": 3.5, "share_of_ideal": 0.22, "selection_share": 0.1}]
    row = summary["step-triton.json"]["rows"][0]
    assert summary["step-triton.json"]["device"] == "NVIDIA H200"
    assert (row["speedup_vs_dense"], row["selection_share_of_attention"], row["host_syncs_per_step"]) == (0.6, 0.79, 314)
    assert "spans" not in row
