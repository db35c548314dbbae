"""Process-group setup for evaluation under torchrun / `sbft eval --nproc N`."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch


@contextlib.contextmanager
def distributed_session() -> Iterator[int]:
    """Join the launcher's process group if started as one of several ranks; yields this rank.

    A group that already exists is used as is (and left open); one created here is destroyed on exit.
    """
    dist = torch.distributed
    created = False
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and dist.is_available() and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
        created = True
    try:
        yield dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    finally:
        if created:
            dist.destroy_process_group()
