"""Start N ranks of `sbft train` through torch's elastic launcher (what `torchrun` runs).

Each rank is a real process; on a CPU they meet over gloo. The elastic agent watches them:
when one rank fails, it stops the others within its monitor interval and reports the failing
rank's exit code and error, so nothing hangs in a collective.
"""
from __future__ import annotations

import os


class RankFailed(Exception):
    def __init__(self, exit_code: int, summary: str):
        super().__init__(summary)
        self.exit_code = exit_code


def inside_launcher() -> bool:
    """True when this process already is one rank of a torchrun / accelerate launch group."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_ranks(nproc: int, module_argv: list[str], module: str = "sbft_cli.app") -> None:
    """Run `python -m MODULE *module_argv` on `nproc` local ranks; raise `RankFailed` if any fails."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Share the cores between the ranks (torchrun would set 1 and warn about it).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.5", "--module", module, *module_argv]
    )
    try:
        run(args)
    except ChildFailedError as error:
        # Ranks the agent stopped show a negative (signal) exit code; the cause is the earliest other one.
        failed = {rank: f for rank, f in error.failures.items() if f.exitcode > 0} or error.failures
        rank, first = min(failed.items(), key=lambda item: (item[1].timestamp, item[0]))
        summary = f"rank {rank} failed with exit code {first.exitcode} (its error is printed above); all ranks were stopped"
        raise RankFailed(2 if first.exitcode == 2 else 1, summary) from None
