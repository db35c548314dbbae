"""Model-side helpers: the tiny locally built checkpoint used by tests and the demo."""
from .tiny import FAMILIES, build_tokenizer, init_tiny, tiny_config

__all__ = ["FAMILIES", "build_tokenizer", "init_tiny", "tiny_config"]
