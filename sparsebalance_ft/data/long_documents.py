"""Long documents (16K-128K tokens) built offline from the Python standard library, split by source.

Every machine that runs `sbft` has a Python standard library, so a long-context run or benchmark can
have long, real, varied text without a download. Its files are cut into *sections* (one file each,
with a header naming it), labelled by kind:

- `code`: a hand-written module's source (`email/message.py`).
- `documentation`: the docstrings of one module, module, classes and functions in source order, each
  under its qualified name: the API reference that the code carries.
- `prose`: the language reference that `pydoc_data/topics.py` holds (one section per topic).
- `templated`: modules that say in their first lines that a tool generated them (the charmap codecs of
  `encodings` from `gencodec.py`, `token.py`, `stringprep.py`...): long tables in one repeated shape.

No machine-generated log text exists in every standard library, so there is no `logs` kind.

A section's *source* is the unit of the train / held-out split: the top-level package or module it
belongs to (`email` for `email/mime/text.py`, and a module's docstrings share its code's source, so
held-out documentation is never trained on through the code), a generated module on its own (each is
made from its own table), a reference topic on its own. A source is held out when a hash of its name
falls in the held-out share, so the split is the same on every machine and Python version, and the
held-out documents of a newer library stay held out.

Documents are then made per split and kind, in sorted source order: a source of at least `min_tokens`
is one document, or several of at most `max_tokens` cut at section boundaries into near-equal parts;
smaller sources (and a big one's short tail) are joined in order until one reaches `min_tokens`; what
is left at the end, shorter than `min_tokens`, is dropped and counted.
"""
from __future__ import annotations

import ast
import hashlib
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .sources import DataError
from .synthetic import length_function

KINDS = ("code", "documentation", "prose", "templated")
SPLITS = ("train", "heldout")
HELDOUT_SHARE = 0.2
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "lib-dynload"})
TOPICS_FILE = Path("pydoc_data") / "topics.py"
# A module that says in its first lines that a tool wrote it ("generated from 'CP1252.TXT' with gencodec.py").
_GENERATED = re.compile(r"(?i)(auto-?generated|generated (?:from|by|with) [^\n]*?\.(?:py|txt)\b|do not edit)")
_GENERATED_HEAD_CHARS = 1500

TokenCounter = Callable[[str], int]


@dataclass(frozen=True)
class Section:
    source: str
    kind: str
    text: str  # header line included
    tokens: int


@dataclass
class LongDocument:
    kind: str
    split: str
    sections: list[Section] = field(default_factory=list)

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(s.source for s in self.sections))

    @property
    def text(self) -> str:
        return "\n".join(s.text for s in self.sections)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sections)


def default_stdlib() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(source: str) -> str:
    """`heldout` for about `HELDOUT_SHARE` of source names, by a hash of the name alone."""
    bucket = int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) / 16**8
    return "heldout" if bucket < HELDOUT_SHARE else "train"


# ------------------------------------------------------------------------------------------ sections


def library_files(stdlib: Path) -> list[Path]:
    """The library's `.py` files, sorted, without tests, installed packages and the reference topics."""
    out = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if rel == TOPICS_FILE or SKIPPED_FOLDERS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        out.append(path)
    return sorted(out, key=lambda p: p.relative_to(stdlib).as_posix())


def _module_name(rel: Path) -> str:
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def docstrings(tree: ast.Module, module: str) -> list[str]:
    """`## qualified.name` then the cleaned docstring, for the module and every class and function that has one."""
    out = []

    def visit(node: ast.AST, name: str) -> None:
        doc = ast.get_docstring(node, clean=True) if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if doc:
            out.append(f"## {name}\n\n{doc}\n")
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{name}.{child.name}")

    visit(tree, module)
    return out


def file_sections(stdlib: Path, path: Path, count: TokenCounter) -> list[Section]:
    """One file's sections: its code (or, when generated, its templated text) and its docstrings."""
    rel = path.relative_to(stdlib)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []  # a file the library itself could not import as source is no document material
    if not text.strip():
        return []
    module = _module_name(rel)
    if _GENERATED.search(text[:_GENERATED_HEAD_CHARS]):
        body = f"# ===== {rel.as_posix()} =====\n{text}"
        return [Section(module, "templated", body, count(body))]
    source = rel.parts[0].removesuffix(".py")
    body = f"# ===== {rel.as_posix()} =====\n{text}"
    sections = [Section(source, "code", body, count(body))]
    try:
        docs = docstrings(ast.parse(text, str(rel)), module)
    except (SyntaxError, ValueError):
        docs = []  # source for another Python version (lib2to3's fixtures): its code is still text
    if docs:
        body = f"# {module}\n\n" + "\n".join(docs)
        sections.append(Section(source, "documentation", body, count(body)))
    return sections


def topic_sections(stdlib: Path, count: TokenCounter) -> list[Section]:
    """The language reference's topics (`pydoc_data/topics.py`, a dict of texts), one section each."""
    path = stdlib / TOPICS_FILE
    if not path.is_file():
        return []
    topics: dict[str, str] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
    out = []
    for name in sorted(topics):
        body = f"== {name} ==\n\n{topics[name].strip()}\n"
        out.append(Section(f"topic:{name}", "prose", body, count(body)))
    return out


def library_sections(stdlib: Path, count: TokenCounter) -> list[Section]:
    """Every section of the library, in a stable order (files by path, topics by name)."""
    if not stdlib.is_dir():
        raise DataError(f"{stdlib}: standard library folder not found")
    sections = [s for path in library_files(stdlib) for s in file_sections(stdlib, path, count)]
    sections += topic_sections(stdlib, count)
    if not sections:
        raise DataError(f"{stdlib}: no Python source files found (is this a standard library folder?)")
    return sections


# ------------------------------------------------------------------------------------------ documents


def _cut_lines(section: Section, max_tokens: int, count: TokenCounter) -> list[Section]:
    """A section longer than `max_tokens` cut at line ends into pieces that each fit (a single line
    longer than that stays whole: there is no line end to cut at)."""
    lines = section.text.splitlines(keepends=True)
    if section.tokens <= max_tokens or len(lines) < 2:
        return [section]
    pieces = max(2, -(-section.tokens // max_tokens))
    bounds = [round(len(lines) * i / pieces) for i in range(pieces + 1)]
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        text = "".join(lines[start:end])
        if text:
            out += _cut_lines(Section(section.source, section.kind, text, count(text)), max_tokens, count)
    return out


def _parts(sections: list[Section], max_tokens: int) -> list[list[Section]]:
    """A source's sections in near-equal consecutive parts, each within `max_tokens`."""
    total = sum(s.tokens for s in sections)
    target = total / max(1, -(-total // max_tokens))
    parts: list[list[Section]] = [[]]
    size = 0
    for s in sections:
        if parts[-1] and size + s.tokens > max_tokens:
            parts.append([])
            size = 0
        parts[-1].append(s)
        size += s.tokens
        if size >= target:
            parts.append([])
            size = 0
    return [p for p in parts if p]


def build_documents(sections: list[Section], min_tokens: int, max_tokens: int,
                    count: TokenCounter) -> tuple[list[LongDocument], list[LongDocument]]:
    """Documents of every split and kind (see the module docstring), and the leftovers dropped as too short."""
    if min_tokens < 1 or max_tokens < 2 * min_tokens:
        raise DataError(f"--max-tokens ({max_tokens}) must be at least twice --min-tokens ({min_tokens}), "
                        "so that short sources joined together always fit")
    by_source: dict[tuple[str, str, str], list[Section]] = {}
    for section in sections:
        for piece in _cut_lines(section, max_tokens, count):
            by_source.setdefault((split_of(section.source), section.kind, section.source), []).append(piece)
    documents: list[LongDocument] = []
    leftovers: list[LongDocument] = []
    for split in SPLITS:
        for kind in KINDS:
            pool = LongDocument(kind, split)
            for key in sorted(k for k in by_source if k[:2] == (split, kind)):
                for part in _parts(by_source[key], max_tokens):
                    if sum(s.tokens for s in part) >= min_tokens:
                        documents.append(LongDocument(kind, split, part))
                        continue
                    pool.sections += part  # < min_tokens, and the pool < min_tokens: together < max_tokens
                    if pool.tokens >= min_tokens:
                        documents.append(pool)
                        pool = LongDocument(kind, split)
            if pool.sections:
                leftovers.append(pool)
    return documents, leftovers


def long_document_records(stdlib: Path, tokenizer: Any, split: str = "train", min_tokens: int = 16384,
                          max_tokens: int = 131072) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """JSONL records (`text`, `kind`, `split`, `sources`, `tokens`) of one split (or `all`), and a summary.

    `tokens` counts the document's text with `tokenizer` (no special tokens): a recipe's loader adds one EOS.
    """
    if split not in (*SPLITS, "all"):
        raise DataError(f"--split {split!r}: choose train, heldout or all")
    count = length_function(tokenizer)

    documents, leftovers = build_documents(library_sections(stdlib, count), min_tokens, max_tokens, count)
    wanted = SPLITS if split == "all" else (split,)
    dropped = [doc for doc in leftovers if doc.split in wanted]
    records = []
    for doc in (doc for doc in documents if doc.split in wanted):
        text = doc.text
        records.append({"text": text, "kind": doc.kind, "split": doc.split, "sources": doc.sources,
                        "tokens": count(text)})
    summary: dict[str, Any] = {"stdlib": str(stdlib), "by_kind": {},
                               "dropped_short": {"documents": len(dropped), "tokens": sum(d.tokens for d in dropped)}}
    for record in records:
        row = summary["by_kind"].setdefault(f"{record['split']}/{record['kind']}", {"documents": 0, "tokens": 0})
        row["documents"] += 1
        row["tokens"] += record["tokens"]
    return records, summary


