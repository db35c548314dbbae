"""Long-context evaluation: passkey / key-value retrieval, needle in a haystack, LongBench-format tasks.

`evaluate(recipe, task, checkpoint=..., attention="dense"|"sparse", out_dir=...)` is the entry
point (`sbft eval` is a thin layer over it); `metrics` holds the scoring functions, `study` the
dense / fixed-sparse / SparseBalance accuracy study.
"""
from .api import TASKS, evaluate, load_for_eval, resolve_checkpoint
from .engine import EvalExample, Scored, generate_greedy, run_examples
from .errors import EvalDataError, EvalError, EvalOptionError
from .longbench import read_longbench

__all__ = [
    "TASKS",
    "EvalDataError",
    "EvalError",
    "EvalExample",
    "EvalOptionError",
    "Scored",
    "evaluate",
    "generate_greedy",
    "load_for_eval",
    "read_longbench",
    "resolve_checkpoint",
    "run_examples",
]
