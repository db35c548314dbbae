"""Metric functions against hand-computed values."""
from __future__ import annotations

import pytest

from sparsebalance_ft.eval import metrics as m


def test_normalize_answer():
    assert m.normalize_answer("  The Cat, sat -- on AN old mat! ") == "cat sat on old mat"


def test_qa_f1_hand_computed():
    # prediction tokens: cat sat on mat (4); reference: cat on mat (3); overlap 3
    # precision 3/4, recall 1 -> F1 = 2 * 0.75 / 1.75
    assert m.qa_f1("The cat sat on the mat", "a cat on a mat") == pytest.approx(6 / 7)
    assert m.qa_f1("Paris", "paris.") == 1.0
    assert m.qa_f1("nothing shared", "other words") == 0.0
    assert m.qa_f1("", "answer") == 0.0
    # tokens count as a multiset: [x y y] vs [y z] share one y: P 1/3, R 1/2
    assert m.qa_f1("x y y", "y z") == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))


def test_qa_f1_zh_per_character():
    # 4 predicted characters, 2 reference characters, 2 shared: P 0.5, R 1 -> 2/3
    assert m.qa_f1_zh("北京大学", "北京。") == pytest.approx(2 / 3)


def test_exact_match():
    assert m.exact_match("The Answer!", "answer") == 1.0
    assert m.exact_match("answers", "answer") == 0.0


def test_rouge_l_hand_computed():
    # LCS of [x y z w] and [x z w] is 3: P 3/4, R 1 -> F 6/7
    assert m.rouge_l("x y z w", "x z w") == pytest.approx(6 / 7)
    # [police killed gunman] vs [gunman was killed by police]: LCS 1, P 1/3, R 1/5 -> F 0.25
    assert m.rouge_l("police killed the gunman", "the gunman was killed by police") == pytest.approx(0.25)
    assert m.lcs_length(list("ABCBDAB"), list("BDCABA")) == 4
    assert m.rouge_l("", "x") == 0.0


def test_edit_similarity_and_code():
    assert m.levenshtein("kitten", "sitting") == 3
    assert m.edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert m.edit_similarity("", "") == 1.0
    prediction = "\n# the next line\n    return x + 1\nprint(x)"
    assert m.first_code_line(prediction) == "    return x + 1"
    assert m.code_similarity(prediction, "return x + 1") == 1.0
    assert m.code_similarity("return x + 2", "return x + 1") == pytest.approx(1 - 1 / 12)


def test_retrieval_count_classification():
    assert m.retrieval_score("Paragraph 3 and paragraph 5", "Paragraph 3") == 0.5
    assert m.retrieval_score("no numbers", "Paragraph 3") == 0.0
    assert m.count_score("There are 7 unique paragraphs", "7") == 1.0
    assert m.count_score("3 or 7", "7") == 0.5
    assert m.classification_score("Type: LOC and NUM", "LOC", ["LOC", "NUM", "HUM"]) == 0.5
    assert m.classification_score("HUM", "LOC", ["LOC", "NUM", "HUM"]) == 0.0


def test_retrieval_exact_and_position_accuracy():
    assert m.retrieval_exact(" 71432. The pass key", "71432") == 1.0
    assert m.retrieval_exact(" 7143", "71432") == 0.0
    assert m.retrieval_exact(" 714321", "71432") == 0.0
    assert m.retrieval_exact(' "cd613e30"', "cd613e30") == 1.0
    assert m.position_accuracy(" 71402", "71432") == pytest.approx(0.8)
    assert m.position_accuracy("nothing", "71432") == 0.0


def test_best_score_takes_the_maximum_reference():
    assert m.best_score("qa_f1", "blue whale", ["whale", "blue whale", "fish"]) == 1.0
    assert m.best_score("qa_f1", "x", []) == 0.0
    assert m.best_score("classification", "NUM", ["NUM"], ["NUM", "LOC"]) == 1.0
