"""Scoring functions for long-context tasks (LongBench conventions, implemented here).

Every function scores one prediction against one reference and returns a float in [0, 1];
`best_score` takes the maximum over a list of references, as LongBench does.

- QA F1: token-level F1 after normalisation (lower case, no punctuation, no English articles,
  collapsed whitespace); Chinese text is compared per character.
- ROUGE-L: F-measure of the longest common subsequence of (normalised) tokens.
- Exact match: normalised strings equal.
- Retrieval: the paragraph number named in the reference ("Paragraph 3") among the numbers
  in the prediction; count: the reference number among the prediction's numbers.
- Code edit similarity: 1 - Levenshtein distance / longer length, on the first line of the
  prediction that is not blank or a comment.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable, Sequence

_PUNCT = set(string.punctuation)
_ZH_PUNCT = set("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃《》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower case, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalize_zh(text: str) -> str:
    """Lower case, drop ASCII and Chinese punctuation and all whitespace."""
    text = text.lower()
    return "".join(ch for ch in text if ch not in _PUNCT and ch not in _ZH_PUNCT and not ch.isspace())


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """F1 of the multiset overlap of two token lists (0 when either is empty or nothing is shared)."""
    common = Counter(prediction_tokens) & Counter(reference_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def qa_f1_zh(prediction: str, reference: str) -> float:
    return token_f1(list(normalize_zh(prediction)), list(normalize_zh(reference)))


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)) time, O(len(b)) memory)."""
    if not a or not b:
        return 0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0] * (len(b) + 1)
        for j, y in enumerate(b, start=1):
            current[j] = previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1])
        previous = current
    return previous[-1]


def rouge_l_tokens(prediction_tokens: Sequence[str], reference_tokens: Sequence[str], beta: float = 1.0) -> float:
    """ROUGE-L F-measure: LCS precision and recall combined with weight `beta` on recall."""
    lcs = lcs_length(prediction_tokens, reference_tokens)
    if lcs == 0:
        return 0.0
    precision = lcs / len(prediction_tokens)
    recall = lcs / len(reference_tokens)
    return (1 + beta**2) * precision * recall / (recall + beta**2 * precision)


def rouge_l(prediction: str, reference: str) -> float:
    return rouge_l_tokens(normalize_answer(prediction).split(), normalize_answer(reference).split())


def rouge_l_zh(prediction: str, reference: str) -> float:
    return rouge_l_tokens(list(normalize_zh(prediction)), list(normalize_zh(reference)))


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        current = [i]
        for j, y in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def edit_similarity(prediction: str, reference: str) -> float:
    """1 - Levenshtein(prediction, reference) / max length; 1.0 for two empty strings."""
    longest = max(len(prediction), len(reference))
    if longest == 0:
        return 1.0
    return 1.0 - levenshtein(prediction, reference) / longest


def first_code_line(prediction: str) -> str:
    """The first line of generated code that is neither blank nor a comment (LongBench's code rule)."""
    for line in prediction.lstrip("\n").split("\n"):
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", "//", "`")):
            return line
    return ""


def code_similarity(prediction: str, reference: str) -> float:
    return edit_similarity(first_code_line(prediction).strip(), reference.strip())


def retrieval_score(prediction: str, reference: str) -> float:
    """Share of numbers in the prediction that equal the reference's paragraph number."""
    wanted = re.findall(r"(?:Paragraph|段落)\s*(\d+)", reference)
    if not wanted:
        return 0.0
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == wanted[0] for n in numbers) / len(numbers)


def count_score(prediction: str, reference: str) -> float:
    """Share of numbers in the prediction equal to the reference count."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == str(reference).strip() for n in numbers) / len(numbers)


def classification_score(prediction: str, reference: str, all_classes: Sequence[str] | None = None) -> float:
    """1/k when the reference is among the k class names the prediction mentions; EM without classes."""
    if not all_classes:
        return exact_match(prediction, reference)
    matched = [c for c in all_classes if c in prediction]
    # A class name contained in a longer matched name that is the reference does not count.
    matched = [c for c in matched if not (c in reference and c != reference)]
    if reference in matched:
        return 1.0 / len(matched)
    return 0.0


def first_integer(text: str) -> str | None:
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


def retrieval_exact(prediction: str, reference: str) -> float:
    """1 when the first token-like run of the prediction equals the reference (passkey, needle, kv)."""
    reference = reference.strip()
    if reference.isdigit():
        return float(first_integer(prediction) == reference)
    match = re.search(r"[0-9A-Za-z]+", prediction)
    return float(match is not None and match.group(0) == reference.strip('"'))


def position_accuracy(prediction: str, reference: str) -> float:
    """Share of the reference's characters reproduced at their position by the prediction's first word.

    A graded companion of `retrieval_exact` (partial credit for "71402" against "71432": 0.8),
    useful while a small model learns to retrieve and exact match is still near zero.
    """
    reference = reference.strip().strip('"')
    if not reference:
        return 0.0
    match = re.search(r"[0-9A-Za-z]+", prediction)
    guess = match.group(0) if match else ""
    return sum(a == b for a, b in zip(guess, reference)) / len(reference)


Metric = Callable[[str, str], float]

METRICS: dict[str, Metric] = {
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge_l": rouge_l,
    "rouge_l_zh": rouge_l_zh,
    "exact_match": exact_match,
    "retrieval": retrieval_score,
    "retrieval_zh": retrieval_score,
    "count": count_score,
    "code_sim": code_similarity,
    "classification": exact_match,  # replaced by classification_score when classes are known
    "retrieval_exact": retrieval_exact,
    "position_accuracy": position_accuracy,
}


def best_score(metric: str, prediction: str, references: Sequence[str], all_classes: Sequence[str] | None = None) -> float:
    """The highest score of `prediction` over `references` (0 without references)."""
    if metric == "classification":
        return max((classification_score(prediction, r, all_classes) for r in references), default=0.0)
    fn = METRICS[metric]
    return max((fn(prediction, r) for r in references), default=0.0)
