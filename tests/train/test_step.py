"""Collective timing: on CUDA the clock stops when the collective completes, not when it is queued."""
from __future__ import annotations

import time

import pytest
import torch

from sparsebalance_ft.train import step


def test_cuda_collectives_are_timed_to_completion(monkeypatch):
    events: list[str] = []

    def synchronize(device=None):  # stands in for the device finishing a queued NCCL all-reduce
        events.append("synchronize")
        time.sleep(0.05)

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    seconds = step.timed_collective(lambda: events.append("enqueue"), torch.device("cuda"))
    assert events == ["enqueue", "synchronize"]
    assert seconds >= 0.05


def test_cpu_collectives_are_timed_as_the_call(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: (_ for _ in ()).throw(AssertionError("synced")))
    seconds = step.timed_collective(lambda: time.sleep(0.02), torch.device("cpu"))
    assert 0.02 <= seconds < 1.0


SLOW_SECONDS = 0.6


def _step_worker(rank: int, port: int, out_dir: str) -> None:
    """One rank of run_local_step on gloo; rank 1's local work takes SLOW_SECONDS longer (its hook sleeps)."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        param = torch.nn.Parameter(torch.zeros(3))
        param.grad = torch.full((3,), float(rank + 1))  # this rank's local gradient

        class Accelerator:
            device = torch.device("cpu")

        slow = (lambda: time.sleep(SLOW_SECONDS)) if rank == 1 else None
        dist.barrier()  # both ranks start the step together
        local = step.run_local_step(Accelerator(), model=None, batches=[], global_target_tokens=1, params=[param],
                                    after_micro_batches=slow)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump({"compute": local.compute_time, "wait": local.wait_time, "grad": param.grad.tolist()}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_fast_rank_waits_for_the_slow_one_and_gradients_are_summed(tmp_path):
    """Two real gloo ranks: the wait a rank records is the slower rank's extra compute, and the one gradient
    all-reduce leaves the sum of both ranks' gradients on each."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_step_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    fast, slow = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert slow["compute"] >= SLOW_SECONDS > fast["compute"]
    assert fast["wait"] >= 0.8 * (slow["compute"] - fast["compute"])  # it waited for rank 1's extra work
    assert slow["wait"] < fast["wait"] / 2  # the slow rank hardly waits: nobody is slower
    assert fast["grad"] == slow["grad"] == [3.0, 3.0, 3.0]  # 1 + 2 on every element
