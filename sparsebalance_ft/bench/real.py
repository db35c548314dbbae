"""`sbft bench real`: the method judged on a real pretrained model (SmolLM2-135M by default).

Four sections, each its own module, written into one `real.json`:

- `selection` (real_selection.selection_curves): kept density, recall and loss against dense per budget,
  selection rule, length and kind of text.
- `passkey` (real_passkey.passkey_curves): where sparse attention loses a needle that dense attention finds.
- `densities` (real_densities): per-document density at the default budget over real documents of three
  kinds and many lengths; the simulator reads it.
- `finetune` (real_finetune): a short long-document LoRA fine-tune under dense, fixed-budget sparse and
  SparseBalance from one initialisation; held-out loss, passkey and time per step after.

Sections run in that order and the file is rewritten after each, so an interrupted run keeps what it
finished; running a subset (`sections`) replaces only those sections of an existing file.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from ..attention.config import SparsityConfig
from ..errors import UserError

SECTIONS = ("selection", "passkey", "densities", "finetune")


@dataclass
class RealPlan:
    """Sizes of the bench; `quick()` fits the whole bench in about ten minutes on two CPU cores."""

    quick: bool = False
    density_docs_per_kind: int = 100
    density_min_tokens: int = 128
    density_max_tokens: int = 8192  # SmolLM2's context: the calibration then reaches 8K measured, not extrapolated
    density_time_limit_s: float | None = None
    seed: int = 0

    @classmethod
    def make(cls, quick: bool) -> "RealPlan":
        if quick:
            return cls(quick=True, density_docs_per_kind=40, density_max_tokens=2048, density_time_limit_s=120.0)
        return cls()


def load_real_model(model_dir: Path):
    """(model in float32 eval mode, tokenizer) of a local checkpoint, one clear line when it is not one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (Path(model_dir) / "config.json").is_file():
        raise UserError(f"--model: not a Hugging Face checkpoint (no config.json): {model_dir}; "
                        f"make one with `sbft init-model smollm2 {model_dir}`")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, tokenizer


def _run_densities(model, tokenizer, model_dir: Path, plan: RealPlan, config: SparsityConfig, work: Path, say) -> dict:
    from .real_densities import densities_section
    from .real_documents import sample_documents

    docs = sample_documents(tokenizer, plan.density_docs_per_kind, plan.density_min_tokens, plan.density_max_tokens,
                            seed=plan.seed)
    say(f"densities: {len(docs)} documents, {sum(d.tokens for d in docs)} tokens")

    def progress(i, doc, density):
        if i % 10 == 0:
            say(f"  densities: {i + 1}/{len(docs)} {doc.kind} {doc.tokens} tokens: density {density:.3f}")

    return densities_section(model, Path(model_dir).name, docs, config, plan.density_time_limit_s, progress)


def _run_selection(model, tokenizer, model_dir: Path, plan: RealPlan, config: SparsityConfig, work: Path, say) -> dict:
    from .real_selection import selection_curves

    return selection_curves(model=model, tokenizer=tokenizer, quick=plan.quick, progress=say)


def _run_passkey(model, tokenizer, model_dir: Path, plan: RealPlan, config: SparsityConfig, work: Path, say) -> dict:
    from .real_passkey import passkey_curves

    return passkey_curves(model=model, tokenizer=tokenizer, quick=plan.quick, progress=say)


def _run_finetune(model, tokenizer, model_dir: Path, plan: RealPlan, config: SparsityConfig, work: Path, say) -> dict:
    from .real_finetune import FinetunePlan, finetune_section

    return finetune_section(Path(model_dir), work / "finetune", FinetunePlan.make(plan.quick), progress=say)


_RUNNERS: dict[str, Callable[..., dict]] = {
    "selection": _run_selection,
    "passkey": _run_passkey,
    "densities": _run_densities,
    "finetune": _run_finetune,
}


def run_real_bench(model_dir: Path, out_dir: Path, sections: list[str], plan: RealPlan, work: Path,
                   say: Callable[[str], None] = print) -> dict:
    """Run the chosen sections on the checkpoint in `model_dir`; write and return `out_dir/real.json`."""
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        raise UserError(f"--sections: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTIONS)}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "real.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    model, tokenizer = load_real_model(model_dir)
    config = SparsityConfig()
    result["setup"] = {"model": str(model_dir), "sparsity": config.model_dump(), "torch_threads": torch.get_num_threads()}
    for name in SECTIONS:
        if name not in sections:
            continue
        started = time.perf_counter()
        section = _RUNNERS[name](model, tokenizer, model_dir, plan, config, work, say)
        if name == "selection":
            from .real_selection import save_curve_png

            save_curve_png(section, out_dir / "selection_curves.png")
        section["elapsed_s"] = time.perf_counter() - started
        section["bench_plan"] = asdict(plan)  # sections of one file may come from runs of different sizes
        result[name] = section
        path.write_text(json.dumps(result, indent=2) + "\n")
        say(f"{name}: done in {section['elapsed_s']:.0f}s")
    return result
