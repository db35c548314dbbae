"""Per-document densities (the `densities` contract of real.json) on the tiny model, against an independent
count of kept blocks from the selection, and the summary's fits on planted rows."""
import numpy as np
import pytest

from sparsebalance_ft.attention.config import SparsityConfig
from sparsebalance_ft.bench.real_densities import densities_section, summarize
from sparsebalance_ft.bench.real_documents import KINDS, content_measures, sample_documents


@pytest.fixture(scope="module")
def documents(tiny_tokenizer):
    return sample_documents(tiny_tokenizer, per_kind=2, min_tokens=64, max_tokens=512, seed=1)


def test_documents_are_interleaved_kinds_within_bounds(documents):
    assert [d.kind for d in documents[:3]] == list(KINDS) and len(documents) == 6
    assert all(64 <= d.tokens <= 512 for d in documents)
    by_kind = {k: [d for d in documents if d.kind == k] for k in KINDS}
    # a passage repeated compresses far better than a real file
    assert max(d.compression_ratio for d in by_kind["repetitive"]) < min(d.compression_ratio for d in by_kind["code"])


def test_content_measures():
    ratio, diversity = content_measures("ab" * 500, np.array([1, 2] * 500))
    assert ratio < 0.05 and diversity == pytest.approx(2 / 1000)


def test_section_follows_the_contract_and_the_kept_blocks(tiny_model, documents):
    config = SparsityConfig(budget=0.3, k_min=1, k_max=2, local_blocks=1, sink_blocks=0)
    section = densities_section(tiny_model, "tiny", documents, config)
    assert {"budget", "block_size", "model", "documents", "summary"} <= section.keys()
    assert section["budget"] == 0.3 and section["block_size"] == 64 and section["model"] == "tiny"
    rows = section["documents"]
    assert len(rows) == len(documents)
    for row, doc in zip(rows, documents):
        assert set(row) == {"kind", "source", "tokens", "density", "compression_ratio", "token_diversity"}
        assert row["tokens"] == doc.tokens and 0 < row["density"] <= 1
        # at most k_max=2 of each query block's causal key blocks: the density cannot exceed that share
        nb = -(-doc.tokens // 64)
        causal = nb * (nb + 1) / 2
        cap = sum(min(2, i + 1) for i in range(nb)) / causal
        assert row["density"] <= cap + 1e-9
    one_block = [r for r in rows if r["tokens"] <= 64]
    assert all(r["density"] == 1.0 for r in one_block)


def test_full_budget_keeps_every_block(tiny_model, documents):
    section = densities_section(tiny_model, "tiny", documents[:3], SparsityConfig(budget=1.0))
    assert all(r["density"] == pytest.approx(1.0) for r in section["documents"])


def test_summary_recovers_a_planted_length_law():
    rng = np.random.default_rng(0)
    rows = []
    for i in range(60):
        tokens = int(2 ** rng.uniform(7, 12))
        density = 1.5 - 0.1 * np.log2(tokens) + (0.05 if i % 3 == 2 else 0.0)
        rows.append({"kind": KINDS[i % 3], "source": "x", "tokens": tokens, "density": density,
                     "compression_ratio": 0.3, "token_diversity": 0.5})
    summary = summarize(rows)
    assert summary["fit_log_length"]["slope_per_doubling"] == pytest.approx(-0.1, abs=0.01)
    # the repetitive kind sits 0.05 above the others once length is accounted for
    by_kind = summary["by_kind"]
    assert by_kind["repetitive"]["mean_length_residual"] - by_kind["code"]["mean_length_residual"] == pytest.approx(0.05, abs=0.01)
    assert sum(b["n"] for b in summary["by_length"]) == 60
