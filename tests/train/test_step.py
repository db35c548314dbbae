"""Collective timing: on CUDA the clock stops when the collective completes, not when it is queued."""
from __future__ import annotations

import time

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


def test_the_wait_is_timed_through_the_seam(monkeypatch):
    """run_local_step times both collectives with timed_collective, the wait (a one-element all-reduce) first."""
    calls: list[str] = []
    monkeypatch.setattr(step, "_distributed", lambda: True)
    monkeypatch.setattr(step.dist, "all_reduce", lambda tensor: calls.append(f"all_reduce {tensor.numel()}"))

    def timed(run, device):
        calls.append(f"timed on {device.type}")
        run()
        return 0.25

    monkeypatch.setattr(step, "timed_collective", timed)
    monkeypatch.setattr(step, "all_reduce_gradients", lambda params: calls.append("gradients"))

    class Accelerator:
        device = torch.device("cpu")

    local = step.run_local_step(Accelerator(), model=None, batches=[], global_target_tokens=1, params=[])
    assert calls == ["timed on cpu", "all_reduce 1", "timed on cpu", "gradients"]
    assert local.wait_time == 0.25 and local.comm_time == 0.25
