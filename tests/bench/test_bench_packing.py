import json

from sparsebalance_ft.bench.packing import compare_packing


def test_packing_bench_times_both_contenders_and_writes_json(tmp_path):
    out = tmp_path / "packing.json"
    result = compare_packing([256, 1024], repeats=3, out=out)
    assert [row["tokens"] for row in result["rows"]] == [256, 1024]
    for row in result["rows"]:
        assert row["own_ms"] > 0 and row["library_ms"] > 0
        assert abs(row["library_over_own"] - row["library_ms"] / row["own_ms"]) < 1e-9
    assert json.loads(out.read_text()) == result
