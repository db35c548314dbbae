"""Start N ranks of an `sbft` command through torch's elastic launcher (what `torchrun` runs), and
turn whatever goes wrong on any rank into one line.

Each rank is a real process; on a CPU they meet over gloo. A rank that fails writes its full
traceback to `LOG_DIR/rank-R.log` and its cause, classified, to the error file the launcher
gives it; it prints nothing, so the user sees only the launcher's one line, which names the
rank that failed first for a reason of its own (a peer's "connection closed" or a collective
timeout is a consequence, reported only when nothing else is known) and its exit code or
signal. Ranks die with their launcher (`PR_SET_PDEATHSIG`), so a killed launcher leaves no
orphan still training.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError

LAUNCHER_PID = "SBFT_LAUNCHER_PID"  # set by `launch_ranks` for its ranks: they stay silent on failure
INTERRUPTED = 130  # the shell's status for Ctrl-C

# What a rank's failure was, most telling first: the launcher reports the earliest of the best kind.
# SIGTERM is how the launcher stops the ranks that are left, so it tells least.
_PRIORITY = {"user": 0, "error": 0, "interrupt": 1, "signal": 2, "timeout": 2, "peer": 3, "stopped": 4}
_PEER_LOST = ("connection closed", "connection reset", "broken pipe", "econnreset", "socket closed", "peer")


class RankFailed(Exception):
    def __init__(self, exit_code: int, summary: str):
        super().__init__(summary)
        self.exit_code = exit_code


def inside_launcher() -> bool:
    """True when this process already is one rank of a torchrun / accelerate launch group."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def single_process_of_many() -> bool:
    """True when `accelerate launch` asked for several processes but started only this one: on a
    machine without GPUs, `--num_processes N` (with or without `--cpu` or a MULTI_CPU config) runs
    one plain process, which it marks only by setting MASTER_ADDR/MASTER_PORT for a group."""
    launched_by_accelerate = "ACCELERATE_DYNAMO_BACKEND" in os.environ or "ACCELERATE_MIXED_PRECISION" in os.environ
    grouped = "MASTER_PORT" in os.environ
    sized = any(k in os.environ for k in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"))
    return launched_by_accelerate and grouped and not sized


def die_with_launcher() -> None:
    """Ask Linux to SIGTERM this rank when the process that started it dies (even by `kill -9`)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    expected = os.environ.get(LAUNCHER_PID)
    if expected and os.getppid() != int(expected):  # the launcher died before the request took effect
        os._exit(128 + signal.SIGTERM)


def _classify(error: BaseException) -> tuple[str, str, int]:
    """(kind, one-line cause, exit code) of an exception that ends a rank."""
    if isinstance(error, UserError):
        return "user", str(error), 2
    if isinstance(error, KeyboardInterrupt):
        return "interrupt", "interrupted", INTERRUPTED
    raw = (str(error).splitlines() or [""])[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", raw)  # drop gloo's source location
    lowered = text.lower()
    collective = type(error).__module__.startswith("torch") or "gloo" in raw.lower() or "nccl" in raw.lower()
    if collective and ("timed out" in lowered or "timeout" in lowered):
        return "timeout", f"another rank stopped responding: {text} (training.collective_timeout)", 1
    if collective and any(word in lowered for word in _PEER_LOST):
        return "peer", f"lost contact with another rank ({text})", 1
    return "error", f"{type(error).__name__}: {text}", 1


def _write_log(log_dir: Path, rank: int, error: BaseException) -> Path:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    for folder in (log_dir, Path(tempfile.gettempdir()) / "sbft-logs"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"rank-{rank}.log"
            path.write_text(text)
            return path
        except OSError:
            continue
    return Path("<unwritable>")


@contextmanager
def rank_errors(log_dir: str | Path):
    """Inside a rank: any failure becomes a log file, an error file for the launcher and an exit code.

    Started by `launch_ranks`, the rank prints nothing (the launcher prints the one line); under
    torchrun or accelerate launch it prints its own line, prefixed with its rank."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        yield
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - every failure leaves the rank here
        kind, cause, code = _classify(error)
        log = _write_log(Path(log_dir), rank, error)
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            record = {"message": cause, "timestamp": int(time.time()), "sbft": {"kind": kind, "time": time.time(), "log": str(log)}}
            Path(error_file).write_text(json.dumps(record))
        if LAUNCHER_PID not in os.environ:
            print(f"error: rank {rank}: {cause} (traceback: {log})", file=sys.stderr)
        sys.stderr.flush()
        os._exit(code)  # no interpreter teardown: a broken process group can hang in its destructors


def _describe(rank: int, failure) -> tuple[int, str]:
    """(exit status for the user, one-line report) of one rank's failure."""
    sbft = failure.error_file_data.get("sbft") if isinstance(failure.error_file_data, dict) else None
    if failure.exitcode < 0:
        name = failure.signal_name()
        return 128 - failure.exitcode, f"rank {rank} was killed by {name} (exit code {failure.exitcode})"
    cause = failure.message if isinstance(failure.message, str) and sbft else "no error recorded"
    log = f"; traceback in {sbft['log']}" if sbft and sbft.get("kind") not in ("user", "interrupt") else ""
    status = failure.exitcode if failure.exitcode in (2, INTERRUPTED) else 1
    return status, f"rank {rank} failed (exit code {failure.exitcode}): {cause}{log}"


def _root_cause(failures: dict) -> tuple[int, object]:
    def key(item):
        rank, failure = item
        sbft = failure.error_file_data.get("sbft") if isinstance(failure.error_file_data, dict) else None
        if sbft:
            kind = sbft["kind"]
        elif failure.exitcode < 0:
            kind = "stopped" if -failure.exitcode == signal.SIGTERM else "signal"
        else:
            kind = "error"
        when = sbft["time"] if sbft else failure.timestamp
        return (_PRIORITY.get(kind, 0), when, rank)

    return min(failures.items(), key=key)


@contextmanager
def _quiet_launcher():
    """The elastic agent's own logging (closing signals, failure tables) is noise next to our one line."""
    names = [name for name in logging.root.manager.loggerDict if name.startswith("torch.distributed")]
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def launch_ranks(nproc: int, module_argv: list[str], module: str = "sbft_cli.app") -> None:
    """Run `python -m MODULE *module_argv` on `nproc` local ranks; raise `RankFailed` if any fails."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Share the cores between the ranks (torchrun would set 1 and warn about it).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[LAUNCHER_PID] = str(os.getpid())
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.5", "--module", module, *module_argv]
    )
    try:
        with _quiet_launcher():
            run(args)
    except ChildFailedError as error:
        rank, failure = _root_cause(error.failures)
        status, line = _describe(rank, failure)
        raise RankFailed(status, f"{line}; all ranks were stopped") from None
    except (KeyboardInterrupt, SignalException) as error:
        received = getattr(error, "sigval", signal.SIGINT)
        status = INTERRUPTED if received == signal.SIGINT else 128 + int(received)
        raise RankFailed(status, f"interrupted ({signal.Signals(received).name}): all ranks were stopped") from None
    finally:
        os.environ.pop(LAUNCHER_PID, None)
