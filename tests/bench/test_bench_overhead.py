"""The overhead benchmark (where the balancer's wall-clock checks live instead of in tests) runs and reports."""
from sparsebalance_ft.bench.overhead import run


def test_overhead_bench_times_each_call():
    result = run(ranks=4, documents=2_000, parts=16, repeats=2)
    for key in ("tune_seconds", "doc_times_seconds", "karmarkar_karp_seconds"):
        assert 0.0 < result[key] < 60.0, key
    assert (result["tune_ranks"], result["documents"], result["parts"]) == (4, 2_000, 16)
