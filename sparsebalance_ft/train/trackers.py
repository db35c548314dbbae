"""Which experiment trackers a run reports to (`training.report_to`), checked before any work starts.

The trackers themselves are accelerate's (`Accelerator(log_with=...)`): tensorboard writes under
OUTPUT_DIR/tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab and trackio use
their own settings (environment variables such as WANDB_PROJECT or MLFLOW_TRACKING_URI).
"""
from __future__ import annotations

from ..errors import UserError
from ..recipe import TrainingConfig


def tracker_names(training: TrainingConfig) -> list[str]:
    """`report_to` as accelerate's `log_with`; an unknown or uninstalled tracker is one line.

    The older `training.tensorboard: false` still works: it removes tensorboard from the list.
    """
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    names = [name for name in dict.fromkeys(training.report_to) if training.tensorboard or name != "tensorboard"]
    installed = {str(t.value) if hasattr(t, "value") else str(t) for t in get_available_trackers()}
    for name in names:
        if name not in LOGGER_TYPE_TO_CLASS:
            known = ", ".join(sorted(LOGGER_TYPE_TO_CLASS))
            raise UserError(f"training.report_to: unknown tracker '{name}' (known: {known}, or none)")
        if name not in installed:
            raise UserError(f"training.report_to: {name} is not installed (pip install {name}), or drop it from report_to")
    return names
