"""Data: sources (JSONL, Parquet, text folders, saved datasets, Hub ids), chat masks, the tokenization cache, packing."""
from .corpus import TokenizedCorpus, load_corpus
from .packing import IGNORE_INDEX, MODEL_KEYS, model_inputs, pack_documents, pack_micro_batch
from .sources import DataError, Document, detect_format, read_documents, render_chat, source_files

__all__ = [
    "DataError",
    "Document",
    "IGNORE_INDEX",
    "MODEL_KEYS",
    "TokenizedCorpus",
    "detect_format",
    "load_corpus",
    "model_inputs",
    "pack_documents",
    "pack_micro_batch",
    "read_documents",
    "render_chat",
    "source_files",
]
