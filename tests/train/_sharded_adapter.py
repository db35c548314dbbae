"""One rank of `test_sharding.py`'s adapter test, started twice by torch.distributed.run:

    python -m torch.distributed.run --standalone --nproc-per-node 2 _sharded_adapter.py RECIPE OUT

Builds the recipe's LoRA model, moves every trainable tensor away from its initial value (seeded, the
same on both ranks), shards it, and writes the sharded model's logits on a fixed input (rank 0) and
the adapter as the trainer saves it (gathered) into OUT.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from sparsebalance_ft.recipe import load_recipe
from sparsebalance_ft.train.checkpoint import save_adapter
from sparsebalance_ft.train.model import load_model
from sparsebalance_ft.train.sharding import shard_model

INPUT_IDS = torch.arange(5, 69).unsqueeze(0)


def main(recipe_path: str, out: str) -> None:
    dist.init_process_group("gloo")
    recipe = load_recipe(recipe_path)
    model, tokenizer = load_model(recipe)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    shard_model(model, recipe, "no", torch.device("cpu"))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=INPUT_IDS).logits
    if dist.get_rank() == 0:
        torch.save(logits, Path(out) / "sharded_logits.pt")
    save_adapter(model, Path(out) / "adapter", tokenizer, dist.get_rank() == 0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
