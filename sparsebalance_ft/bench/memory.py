"""`sbft bench memory`: the peak memory of one training step, each configuration in a fresh process.

A fresh process per configuration, because a process's resident-set high-water mark never goes
down: one big configuration would hide every later one. On CPU the figure is the process's RSS
high-water mark over the step (reset before it through /proc/self/clear_refs, so model building
does not count; the RSS before the step, i.e. weights, optimizer state and the runtime, does);
on CUDA it is `torch.cuda.max_memory_allocated` over the step.

Two training workloads, both through the training's own loss (`train.loss`):
- `loss`: the LM head and the next-token loss alone, from random hidden states;
- `model`: a decoder with SmolLM2-135M's shape (random weights), LoRA as the recipe's defaults
  configure it, one packed document, forward + backward + AdamW step, with dense (SDPA) or
  sparse attention at the default budget, with or without gradient checkpointing.
And one for the sparse attention's own overhead:
- `selection`: one layer's block selection (`SparseAttentionController.select` as the attention calls it, default
  budget) on random queries and keys of one document; its figure is the temporary memory (peak
  less the RSS before the call, which holds q and k), plus the peak of live torch allocations and
  the largest of them from torch's profiler (a second call), which the allocator cannot blur.

A configuration whose RSS passes `cap_gib` is stopped there and recorded as "more than cap",
so a shared machine is never pushed into swapping or the OOM killer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from dataclasses import replace as dataclasses_replace
from pathlib import Path
from typing import Callable

GIB = 2**30
SMOLLM2_SHAPE = dict(vocab_size=49_152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
EXCEEDED_EXIT = 3


@dataclass(frozen=True)
class MemoryCase:
    kind: str  # "loss" | "model" | "selection"
    tokens: int
    loss: str  # "full" | "chunked" | "fused" | "auto"
    attention: str = "-"  # "dense" | "sparse" (model only)
    checkpointing: bool = False

    @property
    def name(self) -> str:
        if self.kind == "loss":
            return f"loss {self.tokens // 1024}K {self.loss}"
        if self.kind == "selection":
            return f"selection {self.tokens // 1024}K"
        ckpt = "ckpt" if self.checkpointing else "no-ckpt"
        return f"model {self.tokens // 1024}K {self.attention} {ckpt} {self.loss}"


TARGET = dict(loss="chunked", attention="sparse", checkpointing=True)
# each undoes one of the three changes of the target, so the table reads what each saved; then all three
ABLATIONS = [dict(TARGET, loss="full"), dict(TARGET, checkpointing=False), dict(TARGET, attention="dense"),
             dict(loss="full", attention="dense", checkpointing=False)]


def default_cases(model_tokens: list[int], loss_tokens: list[int], long_tokens: list[int]) -> list[MemoryCase]:
    """The loss alone (full and chunked), then the target and its ablations at `model_tokens`.

    At `long_tokens` only the target and the ablations that stay sparse: a dense step there takes
    longer on a CPU than all the others together, and the shorter lengths show what it changes.
    """
    cases = [MemoryCase("loss", t, mode) for t in loss_tokens for mode in ("full", "chunked")]
    for t in model_tokens:
        cases += [MemoryCase("model", t, **TARGET)] + [MemoryCase("model", t, **a) for a in ABLATIONS]
    for t in long_tokens:
        cases += [MemoryCase("model", t, **TARGET)] + [MemoryCase("model", t, **a) for a in ABLATIONS[:2]]
    return cases


def selection_cases(tokens: list[int]) -> list[MemoryCase]:
    """One layer's block selection at each length (SmolLM2's heads, the default sparsity config)."""
    return [MemoryCase("selection", t, "-") for t in tokens]


# --------------------------------------------------------------------------- inside the measured process


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """Make VmHWM restart from the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _watch_rss(cap_bytes: int, case: MemoryCase) -> None:
    """Stop the process once it holds more than `cap_bytes`, recording that it did."""
    def watch() -> None:
        while True:
            rss = _status_kib("VmRSS") * 1024
            if rss > cap_bytes:
                print(json.dumps({"case": asdict(case), "exceeded_bytes": cap_bytes}), flush=True)
                os._exit(EXCEEDED_EXIT)
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()


def _loss_step(case: MemoryCase, device) -> Callable[[], float]:
    import torch

    from ..train.loss import CausalLMParts, token_loss

    torch.manual_seed(0)
    shape = SMOLLM2_SHAPE
    head = torch.nn.Linear(shape["hidden_size"], shape["vocab_size"], bias=False, device=device)
    head.weight.requires_grad_(False)  # frozen, as under LoRA
    hidden = torch.randn(case.tokens, shape["hidden_size"], device=device, requires_grad=True)
    targets = torch.randint(0, shape["vocab_size"], (case.tokens,), device=device)
    parts = CausalLMParts(None, head, shape["vocab_size"], None, None)

    def step() -> float:
        loss = token_loss(parts, hidden, targets, case.loss)
        (loss / case.tokens).backward()
        return float(loss.detach()) / case.tokens

    return step


def _model_step(case: MemoryCase, device) -> Callable[[], float]:
    import torch
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..attention import SparseAttentionController, SparsityConfig
    from ..recipe import LoraConfig
    from ..train.loss import micro_batch_loss
    from ..train.model import enable_checkpointing

    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_SHAPE, max_position_embeddings=max(8192, case.tokens), attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device)
    lora = LoraConfig()
    model = get_peft_model(model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                                                 task_type="CAUSAL_LM"))
    if case.attention == "sparse":
        SparseAttentionController.attach(model, SparsityConfig())
    if case.checkpointing:
        enable_checkpointing(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(3, SMOLLM2_SHAPE["vocab_size"], (1, case.tokens), device=device)
    labels = ids.clone()
    labels[0, 0] = -100
    batch = {"input_ids": ids, "position_ids": torch.arange(case.tokens, device=device)[None], "labels": labels}

    def step() -> float:
        loss, count = micro_batch_loss(model, batch, case.loss)
        (loss / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()) / count

    return step


def _selection_step(case: MemoryCase, device) -> Callable[[], float]:
    """One layer's block selection, the call `attention.register._choose_route` makes
    (`SparseAttentionController.select` at the default budget), on random q and k of one document; returns
    the kept density."""
    import torch

    from ..attention import SparsityConfig
    from ..attention.budget import SparseAttentionController
    from ..attention.selection import make_layout, to_layout

    torch.manual_seed(0)
    config = SparsityConfig()
    heads, kv_heads = SMOLLM2_SHAPE["num_attention_heads"], SMOLLM2_SHAPE["num_key_value_heads"]
    head_dim = SMOLLM2_SHAPE["head_dim"]
    layout = make_layout([case.tokens], config.block_size, device)
    q = to_layout(torch.randn(1, heads, case.tokens, head_dim, device=device), layout)[0]
    k = to_layout(torch.randn(1, kv_heads, case.tokens, head_dim, device=device), layout)[0]
    controller = SparseAttentionController(config)

    def select(q: torch.Tensor, k: torch.Tensor, layout) -> float:
        return controller.select(q, k, layout, config.budget, head_dim ** -0.5).density

    # a first call on 16 blocks pages in the ops' code, which would otherwise count as the call's RSS
    small = make_layout([16 * config.block_size], config.block_size, device)
    select(q[:, :small.padded_length], k[:, :small.padded_length], small)
    return lambda: select(q, k, layout)


def profiled_allocations(call: Callable[[], object], largest: int = 5) -> dict:
    """Peak bytes of the CPU tensors `call` keeps alive at once (above those alive before it), and its
    `largest` allocations with the op that made each: torch's profiler records every allocation and free
    (the allocation events of its event tree, the ones its memory timeline reads), so this is the tensors'
    own peak, free of what the allocator caches or returns to the system."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    allocations = []  # (start ns, bytes: positive allocated, negative freed, op)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            op = event.parent.name if event.parent is not None else "-"
            allocations.append((event.start_time_ns, event.extra_fields.alloc_size, op))
    allocations.sort(key=lambda a: a[0])
    live = peak = 0
    for _, size, _ in allocations:
        live += size
        peak = max(peak, live)
    top = sorted((a for a in allocations if a[1] > 0), key=lambda a: -a[1])[:largest]
    return {"torch_peak_bytes": peak, "largest_allocations": [{"op": op, "bytes": size} for _, size, op in top]}


STEP_BUILDERS = {"loss": _loss_step, "model": _model_step, "selection": _selection_step}


def measure_case(case: MemoryCase, device_name: str = "cpu", cap_gib: float | None = None) -> dict:
    """Build the workload, then measure one step's peak (run this in a fresh process)."""
    import torch

    torch.set_num_threads(int(os.environ.get("SBFT_BENCH_THREADS", "1")))
    device = torch.device(device_name)
    step = STEP_BUILDERS[case.kind](case, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = _status_kib("VmRSS") * 1024
        _reset_peak_rss()
        if cap_gib:
            _watch_rss(int(cap_gib * GIB), case)
    started = time.perf_counter()
    loss = step()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) if cuda else _status_kib("VmHWM") * 1024
    result = {"case": asdict(case), "name": case.name, "device": device_name,
              "measure": "cuda max_memory_allocated" if cuda else "process RSS high-water mark",
              "before_step_bytes": before, "peak_bytes": peak, "step_seconds": round(seconds, 2),
              "density" if case.kind == "selection" else "loss": loss}
    if case.kind == "selection" and not cuda:
        result.update(profiled_allocations(step))
    return result


# --------------------------------------------------------------------------- the accounting


@dataclass(frozen=True)
class Shape:
    """What the memory of a decoder's training step depends on."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    parameters: int
    dtype_bytes: int  # weights and activations


SMOLLM2 = Shape("SmolLM2-135M (float32)", 30, 576, 9, 3, 64, 1536, 49_152, 134_515_008, 4)
LLAMA3_8B = Shape("Llama-3-8B (bfloat16)", 32, 4096, 32, 8, 128, 14_336, 128_256, 8_030_261_248, 2)
LLAMA3_70B = Shape("Llama-3-70B (bfloat16)", 80, 8192, 64, 8, 128, 28_672, 128_256, 70_553_706_496, 2)


def layer_parameters(shape: Shape) -> int:
    """One decoder layer's weights: attention projections, the gated MLP, two norms."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return shape.hidden * (2 * q + 2 * kv) + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden


def lora_parameters(shape: Shape, r: int = 8) -> int:
    """LoRA on q, k, v, o (the recipe's default targets): r x (in + out) per projection."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return shape.layers * r * ((shape.hidden + q) * 2 + (shape.hidden + kv) * 2)


def selection_scores_bytes(shape: Shape, tokens: int, block: int = 64) -> float:
    """The accounting's term for one layer's selection: float32 block scores for every query head."""
    return shape.heads * (tokens / block) ** 2 * 4


def projected_peak(shape: Shape, tokens: int, checkpointing: bool, loss: str, attention: str = "sparse",
                   block: int = 64, shards: int = 1) -> dict[str, float]:
    """Bytes of one LoRA training step's peak, by component, and their `total`.

    - a decoder layer keeps ~9 hidden-sized, 2 key/value-sized and 4 intermediate-sized tensors per
      token for backward (norm inputs and outputs, attention inputs and output, o_proj input; the
      MLP's gate, up, activation and down input); checkpointing keeps only each layer's input and
      recomputes one layer at a time during backward, where 2 intermediate-sized gradients are live;
    - full logits: the head's output, its float32 copy (bf16 only), the log-softmax and its gradient,
      `tokens x vocab` each; chunked: four float32 tensors of one chunk;
    - sparse attention's selection (as of issue 12 item 2 still open): per layer, float32 block scores
      for every query head, `heads x (tokens / block)^2`, transient;
    - the loss's backward runs before the layers', so logits and the layer recompute do not coexist;
    - sharded over `shards` ranks (`training.sharding: fsdp`), each rank keeps 1/shards of the weights
      and of the LoRA state, and holds whole ("gathered") what is being computed: the root's embedding
      and head (for the loss) and two decoder layers (the one running and the next one's gather).
    """
    d = shape.dtype_bytes
    per_layer = tokens * d * (9 * shape.hidden + 2 * shape.kv_heads * shape.head_dim + 4 * shape.intermediate)
    kept = shape.layers * (tokens * d * shape.hidden if checkpointing else per_layer)
    backward = 2 * tokens * d * shape.intermediate + (per_layer if checkpointing else 0)
    if attention == "sparse":
        backward += selection_scores_bytes(shape, tokens, block)
    if loss == "full":
        logits = tokens * shape.vocab * (d + (4 if d != 4 else 0) + 8)
    else:
        from ..train.loss import CHUNK_LOGIT_BYTES

        logits = 4 * CHUNK_LOGIT_BYTES
    root = shape.parameters - shape.layers * layer_parameters(shape)  # embedding, head, final norm
    parts = {
        "weights": shape.parameters * d / shards,
        "gathered": (root + 2 * layer_parameters(shape)) * d if shards > 1 else 0.0,
        "lora_state": lora_parameters(shape) * 16 / shards,  # float32 weights, gradients and two AdamW moments
        "kept_activations": kept,
        "hidden_and_grad": 2 * tokens * shape.hidden * d,
        "logits": logits,
        "layer_backward": backward,
    }
    parts["total"] = (parts["weights"] + parts["gathered"] + parts["lora_state"] + kept + parts["hidden_and_grad"]
                      + max(logits, backward))
    return parts


def projected_step(case: MemoryCase, shape: Shape = SMOLLM2) -> float:
    """The step's own bytes (peak less weights and LoRA state) that `case` should measure, per the accounting."""
    if case.kind == "selection":
        return selection_scores_bytes(shape, case.tokens)
    if case.kind == "loss":
        one = dataclasses_replace(shape, layers=0, parameters=0)
        parts = projected_peak(one, case.tokens, False, case.loss, "dense")
        return parts["logits"] + parts["hidden_and_grad"]
    parts = projected_peak(shape, case.tokens, case.checkpointing, case.loss, case.attention)
    return parts["total"] - parts["weights"] - parts["lora_state"]


# --------------------------------------------------------------------------- the driver


def run_case(case: MemoryCase, device: str, cap_gib: float | None, timeout_s: float | None,
             mmap_threshold: int | None = None) -> dict:
    """One configuration in a fresh interpreter; its result, or why it has none.

    `mmap_threshold` sets glibc's MALLOC_MMAP_THRESHOLD_ in that process: blocks at least that large
    are then returned to the system when torch frees them, instead of staying in the RSS.
    """
    command = [sys.executable, "-m", "sparsebalance_ft.bench.memory", json.dumps(asdict(case)), device,
               str(cap_gib or 0)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(mmap_threshold)) if mmap_threshold else None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"case": asdict(case), "name": case.name, "skipped": f"took longer than {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"case": asdict(case), "name": case.name, "error": f"exit {done.returncode}: {last}"}
    result = json.loads(lines[-1])
    result["name"] = case.name
    result["projected_step_bytes"] = projected_step(case)
    result["malloc_mmap_threshold"] = mmap_threshold
    return result


def result_row(result: dict) -> dict:
    """One table row: the configuration, peak GiB (or '> cap'), the step's own GiB, measured vs projected."""
    case = result["case"]
    row = {"config": result["name"], "tokens": case["tokens"], "peak_gib": None, "step_gib": None,
           "projected_step_gib": round(projected_step(MemoryCase(**case)) / GIB, 2), "seconds": None, "note": ""}
    if "peak_bytes" in result:
        row.update(peak_gib=round(result["peak_bytes"] / GIB, 2), seconds=result["step_seconds"],
                   step_gib=round((result["peak_bytes"] - result["before_step_bytes"]) / GIB, 2))
    elif "exceeded_bytes" in result:
        row["note"] = f"stopped above {result['exceeded_bytes'] / GIB:.0f} GiB"
    else:
        row["note"] = result.get("error") or result.get("skipped", "")
    return row


def selection_row(result: dict) -> dict:
    """One table row of the selection workload, in MiB: temporary RSS, torch's peak, the largest tensor."""
    mib = 2**20
    row = {"config": result["name"], "tokens": result["case"]["tokens"], "rss_temp_mib": None, "torch_peak_mib": None,
           "largest_mib": None, "projected_scores_mib": round(projected_step(MemoryCase(**result["case"])) / mib, 1),
           "seconds": None, "note": ""}
    if "peak_bytes" in result:
        row.update(rss_temp_mib=round((result["peak_bytes"] - result["before_step_bytes"]) / mib, 1),
                   seconds=result["step_seconds"])
    if "torch_peak_bytes" in result:
        row["torch_peak_mib"] = round(result["torch_peak_bytes"] / mib, 1)
        largest = result["largest_allocations"]
        row["largest_mib"] = round(largest[0]["bytes"] / mib, 1) if largest else 0.0
    if "peak_bytes" not in result:
        row["note"] = result_row(result)["note"]
    return row


def projection_rows(shape: Shape = LLAMA3_8B, tokens: tuple[int, ...] = (32_768, 65_536, 131_072),
                    shards: int = 1) -> list[dict]:
    """The accounting's per-rank peak for `shape` with LoRA: the target and each one-change ablation, in GB."""
    rows = []
    for t in tokens:
        for ckpt, loss in ((True, "chunked"), (True, "full"), (False, "chunked")):
            parts = projected_peak(shape, t, ckpt, loss, shards=shards)
            rows.append({"tokens": t, "shards": shards, "checkpointing": ckpt, "loss": loss,
                         **{k: round(v / 1e9, 1) for k, v in parts.items()}})
    return rows


def code_version() -> dict:
    """The commit the measured code came from, whether the work tree differed from it, and the git blob
    of `attention/selection.py` (the selection workload's subject): a 'before' and an 'after' then name
    the code each measured."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--", "sparsebalance_ft")),
            "selection_py_blob": git("hash-object", "sparsebalance_ft/attention/selection.py") or None}


def run_memory_bench(cases: list[MemoryCase], out: Path, device: str = "cpu", cap_gib: float | None = 12.0,
                     timeout_s: float | None = None, on_result: Callable[[dict], None] | None = None,
                     mmap_threshold: int | None = None) -> dict:
    """Measure every case, rewriting the JSON `out` after each (a long run keeps what it has)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": device, "cap_gib": cap_gib, "shape": SMOLLM2_SHAPE,
              "threads": int(os.environ.get("SBFT_BENCH_THREADS", "1")), "malloc_mmap_threshold": mmap_threshold,
              "code": code_version(), "results": []}
    for case in cases:
        result = run_case(case, device, cap_gib, timeout_s, mmap_threshold)
        report["results"].append(result)
        out.write_text(json.dumps(report, indent=1))
        if on_result is not None:
            on_result(result)
    return report


def main(argv: list[str]) -> None:
    case = MemoryCase(**json.loads(argv[0]))
    cap = float(argv[2]) or None
    print(json.dumps(measure_case(case, argv[1], cap)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
