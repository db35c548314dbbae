"""sparsebalance-ft: long-context LoRA fine-tuning with dynamic sparse attention, load-balanced across ranks."""

__version__ = "0.1.0"
