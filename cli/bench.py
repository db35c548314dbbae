"""`sbft bench attention` (one attention layer, sparse vs dense SDPA), `sbft bench selection` (the
selection rules at matched density), `sbft bench balance` (the same training run under baseline, SAB,
DST, SAB+DST and dense attention, on real ranks), `sbft bench accuracy` (the accuracy study), `sbft bench
memory` (peak memory of one training step), `sbft bench step` (a whole training step, dense against sparse) and
`sbft bench extend` (context extension before and after fine-tuning)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from .common import console, user_errors

bench_app = typer.Typer(help="Micro-benchmarks.", no_args_is_help=True)


def _floats(text: str, name: str) -> list[float]:
    from sparsebalance_ft.errors import UserError

    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--{name}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise UserError(f"--{name}: empty list")
    return values


def _require_whole_blocks(length: int) -> None:
    from sparsebalance_ft.errors import UserError

    if length % 64:
        raise UserError(f"--length: must be a multiple of the block size 64, got {length}")


def _native_positions(model: Path) -> int:
    """The checkpoint's `max_position_embeddings`; a folder without a config.json is a one-line error."""
    from sparsebalance_ft.errors import UserError

    if not (model / "config.json").is_file():
        raise UserError(f"--model: not a Hugging Face checkpoint (no config.json): {model}")
    return json.loads((model / "config.json").read_text())["max_position_embeddings"]


@bench_app.command("attention")
@user_errors
def attention(
    lengths: str = typer.Option("4096,8192,16384,32768", help="Comma-separated sequence lengths (tokens)."),
    densities: str = typer.Option("0.05,0.1,0.25,1.0", help="Comma-separated target densities (share of causal blocks); 1.0 = full budget."),
    repeats: int = typer.Option(1, min=1, help="Alternating sparse/dense repetitions (median reported)."),
    heads: int = typer.Option(8, min=1, help="Query heads."),
    kv_heads: int = typer.Option(2, min=1, help="Key-value heads (GQA)."),
    head_dim: int = typer.Option(64, min=8),
    block_size: int = typer.Option(64, min=16),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    device: str = typer.Option("cpu"),
    backend: str = typer.Option("auto", help="auto, torch, flex or triton."),
    dense: bool = typer.Option(True, "--dense/--no-dense", help="Also time dense SDPA (off: memory checks at long lengths)."),
    kernel_at_full: bool = typer.Option(False, help="Also time the sparse kernel keeping every block."),
    clock: str = typer.Option("wall", help="wall, or cpu: this process's CPU time (CPU, with OMP_NUM_THREADS=1) on a shared machine."),
    out: Path | None = typer.Option(None, "--out", help="Write the results as JSON here."),
) -> None:
    """Time sparse vs dense attention and print a table (speedup, ideal speedup, memory, selection share)."""
    from sparsebalance_ft.attention.config import SparsityConfig
    from sparsebalance_ft.bench.attention import run_attention_bench
    from sparsebalance_ft.errors import UserError

    lens = [int(x) for x in _floats(lengths, "lengths")]
    dens = _floats(densities, "densities")
    if any(d <= 0 or d > 1 for d in dens):
        raise UserError("--densities: each must be in (0, 1]")
    if heads % kv_heads:
        raise UserError(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype: unknown {dtype!r}")
    if backend not in ("auto", "torch", "flex", "triton"):
        raise UserError(f"--backend: unknown {backend!r}")
    if clock not in ("wall", "cpu") or (clock == "cpu" and device != "cpu"):
        raise UserError(f"--clock: wall, or cpu on --device cpu (got {clock!r} on {device})")
    try:
        SparsityConfig(block_size=block_size)
    except ValueError as e:
        raise UserError(f"--block-size: {e}") from None

    def progress(length, density, sparse_s, dense_s):
        d = f", dense {dense_s:.2f}s" if dense_s is not None else ""
        console.print(f"  L={length} density={density:g}: sparse {sparse_s:.2f}s{d}", highlight=False)

    result = run_attention_bench(lens, dens, repeats, heads, kv_heads, head_dim, block_size, dtype, device, backend,
                                 dense, kernel_at_full, progress=progress, clock=clock)
    s = result["setup"]
    table = Table(title=f"attention fwd+bwd: {s['heads']} q heads, {s['kv_heads']} kv heads, head_dim {s['head_dim']}, "
                        f"block {s['block_size']}, {s['dtype']}, {s['device']} ({s['torch_threads']} threads)")
    for col in ("length", "density", "route", "sparse s", "dense s", "speedup", "ideal", "of ideal", "select share",
                "sparse MiB", "dense MiB"):
        table.add_column(col, justify="right")
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    for r in result["rows"]:
        table.add_row(str(r["length"]), f(r["density"], 3), r["route"], f(r["sparse_s"]), f(r["dense_s"]),
                      f(r["speedup"]), f(r["ideal_speedup"], 1), f(r["share_of_ideal"]),
                      f(r["selection_share"]), f(r["sparse_peak_mb"], 0), f(r["dense_peak_mb"], 0))
    console.print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        console.print(f"wrote {out}")


@bench_app.command("selection")
@user_errors
def selection(
    model: Path = typer.Option(Path("runs/tiny-llama"), "--model", help="Tiny model folder (init-tiny writes one if missing)."),
    length: int = typer.Option(4096, min=256, help="Tokens per sequence (one document)."),
    sequences: int = typer.Option(2, min=1, help="Standard-library files run through the model."),
    out: Path = typer.Option(Path("bench_results/selection.json"), "--out", help="Results as JSON."),
) -> None:
    """Sweep the budget under each selection rule and compare recall at matched density."""
    from sparsebalance_ft.bench.selection import RULES, compare_selection_rules

    _require_whole_blocks(length)
    result = compare_selection_rules(model, length, sequences, out=out)
    for name, source in result["sources"].items():
        table = Table(title=f"{name}: recall at matched density ({source['note']})")
        for col in ("density", *RULES):
            table.add_column(col, justify="right")
        for row in source["matched"]:
            table.add_row(f"{row['density']:g}", *("-" if row[r] is None else f"{row[r]:.3f}" for r in RULES))
        console.print(table)
    console.print(f"wrote {out}")


@bench_app.command("score-precision")
@user_errors
def score_precision(
    model: Path = typer.Option(Path("runs/smollm2"), "--model", help="Real checkpoint folder (`sbft init-model smollm2 DIR`)."),
    length: int = typer.Option(8192, min=256, help="Tokens read (one standard-library source; at most the model's context)."),
    repeats: int = typer.Option(3, min=1, help="Timed selections per layer and precision, interleaved (medians reported)."),
    out: Path = typer.Option(Path("bench_results/selection/score-precision.json"), "--out", help="Results as JSON."),
) -> None:
    """Block selection scored in bfloat16 (`score_precision: auto`) against float32: kept blocks, recall, time."""
    from sparsebalance_ft.bench.score_precision import compare_score_precision
    from sparsebalance_ft.errors import UserError

    _require_whole_blocks(length)
    native = _native_positions(model)
    if length > native:
        raise UserError(f"--length {length} is above the model's {native} positions: the scores past them mean nothing")
    result = compare_score_precision(model, length, repeats, out=out, say=lambda line: console.print(line, highlight=False))
    s = result["summary"]
    console.print(f"auto scores in {result['setup']['auto_dtype']}: {s['agreement']:.4%} of keep decisions agree; "
                  f"density {s['float32']['density']:.4f} -> {s['auto']['density']:.4f}, recall "
                  f"{s['float32']['recall']:.4f} -> {s['auto']['recall']:.4f}; selection {s['auto_speedup']:.2f}x faster")
    console.print(f"wrote {out}")


@bench_app.command("packing")
@user_errors
def packing(
    tokens: str = typer.Option("4096,32768,131072", help="Micro-batch sizes in tokens (8 documents each)."),
    repeats: int = typer.Option(20, min=1, help="Alternating repetitions per size (medians reported)."),
    out: Path = typer.Option(Path("bench_results/packing.json"), "--out", help="Results as JSON."),
) -> None:
    """Pack time per micro-batch: the project's numpy packing against DataCollatorWithFlattening."""
    from sparsebalance_ft.bench.packing import compare_packing

    result = compare_packing([int(t) for t in _floats(tokens, "tokens")], repeats, out=out)
    table = Table(title="packing one micro-batch (median ms)")
    for col in ("tokens", "numpy", "DataCollatorWithFlattening", "library / numpy"):
        table.add_column(col, justify="right")
    for row in result["rows"]:
        table.add_row(f"{row['tokens']:,}", f"{row['own_ms']:.2f}", f"{row['library_ms']:.2f}", f"{row['library_over_own']:.1f}x")
    console.print(table)
    console.print(f"wrote {out}")


@bench_app.command("balance")
@user_errors
def balance(
    recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="Recipe of the run every configuration repeats."),
    out: Path = typer.Option(Path("bench_results/balance"), "--out", help="Folder for the runs and balance.json."),
    rounds: int = typer.Option(1, min=1, help="Times each configuration runs, interleaved (medians reported)."),
    nproc: int = typer.Option(2, min=1, help="Ranks per run."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key for every configuration."),
    configs: str = typer.Option(
        "peer,baseline,sab,dst,sab+dst,sab+layer,sab+fill,dense", "--configs",
        help="Configurations to run, comma-separated, in this order (speedups are against peer when it runs).",
    ),
) -> None:
    """The best fair peer (length-grouped, fixed budget; the baseline of every speedup), random batching, SAB, DST,
    SAB+DST, SAB + layer-level DST, SAB + layer-level DST filling up to the slowest rank (free accuracy) and dense, measured alternately."""
    from sparsebalance_ft.bench.balance import CONFIGURATIONS, check_same_documents, run_balance_bench
    from sparsebalance_ft.errors import UserError
    from sparsebalance_ft.recipe import load_recipe

    # fail here, in one line, rather than inside a rank
    recipe = load_recipe(recipe_path, overrides or [])
    check_same_documents(recipe.training.max_steps, recipe.balance.lookahead_steps)
    names = [name.strip() for name in configs.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONFIGURATIONS]
    if unknown or not names:
        raise UserError(f"--configs: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(CONFIGURATIONS)}")

    def progress(round_index, name, row):
        console.print(
            f"  round {round_index}: {name:8s} train {row['train_time']:.1f}s  bubble {row['bubble']:.1%}  "
            f"loss {row['final_loss']:.3f}",
            highlight=False,
        )

    console.print(f"{len(names)} configurations x {rounds} round(s), {nproc} ranks each")
    report = run_balance_bench(recipe_path, out, rounds, nproc, overrides or [], names, on_result=progress)
    table = Table(title=f"balancing, {nproc} ranks, median of {rounds} round(s)")
    for col in ("config", "train s", "speedup", "step s", "bubble", "imbalance", "budget", "density", "recall", "final loss"):
        table.add_column(col, justify="right")
    f = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    for name, r in report["results"].items():
        speedup = r.get("speedup_vs_peer", r.get("speedup_vs_baseline"))
        table.add_row(name, f(r["train_time"], 1), f(speedup, 2), f(r["mean_step_time"]),
                      f(r["bubble"]), f(r["imbalance"]), f(r["mean_budget"]), f(r["mean_density"]),
                      f(r["mean_recall"]), f(r["final_loss"]))
    console.print(table)
    if not report["same_documents"]:
        console.print("[red]configurations trained different token totals: their times are not comparable[/red]")
    console.print(f"wrote {out / 'balance.json'}")


@bench_app.command("accuracy")
@user_errors
def accuracy(
    out: Path = typer.Option(Path("bench_results/accuracy"), "--out", help="Results: JSON, Markdown table, heatmaps."),
    work: Path = typer.Option(Path("runs/accuracy"), "--work", help="Tiny model, training data and training runs."),
    quick: bool = typer.Option(False, "--quick", help="Smoke-sized plan (about a minute)."),
    nproc: Optional[int] = typer.Option(None, "--nproc", min=1, help="Ranks per training run."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Training steps per arm."),
    reuse: bool = typer.Option(False, "--reuse", help="Keep arms already trained in --work; evaluate only."),
) -> None:
    """Train the tiny model dense, fixed-budget sparse and SparseBalance from one init; passkey accuracy and recall."""
    from sparsebalance_ft.eval.study import (
        DEFAULT_ARMS,
        StudyPlan,
        launch_trainer,
        prepare_study,
        run_accuracy_study,
        study_table,
    )

    plan = StudyPlan.quick() if quick else StudyPlan()
    if nproc is not None:
        plan.nproc = nproc
    if steps is not None:
        plan.max_steps = steps
    base = prepare_study(work, plan)
    result = run_accuracy_study(base, DEFAULT_ARMS, launch_trainer(plan.nproc), out, plan=plan, work_dir=work, reuse=reuse)
    console.print(study_table(result), highlight=False)


@bench_app.command("memory")
@user_errors
def memory(
    loss_tokens: str = typer.Option("16384,32768,65536", help="Token counts for the loss alone (full vs chunked); empty: none."),
    model_tokens: str = typer.Option("8192,16384", help="Token counts for the SmolLM2-shaped model: target and every ablation."),
    long_tokens: str = typer.Option("32768", help="Token counts for the model: target and the sparse ablations only."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    cap_gib: float = typer.Option(12.0, min=0.0, help="Stop a configuration once it holds more (CPU); 0: no cap."),
    timeout: float = typer.Option(3600.0, min=1.0, help="Seconds one configuration may take."),
    out: Path = typer.Option(Path("bench_results/memory/memory.json"), "--out", help="Results as JSON."),
    project: bool = typer.Option(False, "--project", help="Print the accounting's projection for Llama-3-8B and 70B with LoRA; run nothing."),
    shards: str = typer.Option("1", "--shards", help="With --project: rank counts the model is sharded over (training.sharding: fsdp), e.g. 1,8."),
    mmap_threshold: int = typer.Option(0, min=0, help="glibc MALLOC_MMAP_THRESHOLD_ in each process (e.g. 65536: freed blocks leave the RSS); 0: glibc's default."),
    workload: str = typer.Option("train", help="train: the loss alone and the whole model; selection: one layer's block selection."),
    selection_tokens: str = typer.Option("16384,32768,65536", help="Token counts for --workload selection."),
) -> None:
    """Peak memory of one training step (loss alone; whole model), or of one layer's block selection
    (--workload selection), each configuration in a fresh process."""
    from sparsebalance_ft.bench.memory import (GIB, LLAMA3_8B, LLAMA3_70B, default_cases, projection_rows, result_row,
                                               run_memory_bench, selection_cases, selection_row)

    if project:
        columns = ("tokens", "shards", "checkpointing", "loss", "weights", "gathered", "kept_activations", "logits",
                   "layer_backward", "total")
        for shape in (LLAMA3_8B, LLAMA3_70B):
            table = Table(title=f"projected peak per rank, {shape.name} + LoRA r=8 (GB)")
            for col in columns:
                table.add_column(col, justify="right")
            for n in [int(x) for x in _floats(shards, "shards")]:
                for row in projection_rows(shape, shards=n):
                    table.add_row(*(str(row[c]) for c in columns))
            console.print(table)
        return

    def ints(text: str, name: str) -> list[int]:
        return [int(x) for x in _floats(text, name)] if text.strip() else []

    if workload not in ("train", "selection"):
        from sparsebalance_ft.errors import UserError

        raise UserError(f"--workload: expected train or selection, got {workload!r}")
    if workload == "selection":
        cases = selection_cases(ints(selection_tokens, "selection-tokens"))
    else:
        cases = default_cases(ints(model_tokens, "model-tokens"), ints(loss_tokens, "loss-tokens"),
                              ints(long_tokens, "long-tokens"))

    def show(r: dict) -> None:
        if "peak_bytes" in r:
            console.print(f"  {r['name']}: peak {r['peak_bytes'] / GIB:.2f} GiB, {r['step_seconds']:.0f} s", highlight=False)
        elif "exceeded_bytes" in r:
            console.print(f"  {r['name']}: more than {r['exceeded_bytes'] / GIB:.0f} GiB (stopped)", highlight=False)
        else:
            console.print(f"  {r['name']}: {r.get('error') or r.get('skipped')}", highlight=False)

    console.print(f"{len(cases)} configurations, one fresh process each")
    report = run_memory_bench(cases, out, device, cap_gib or None, timeout, on_result=show,
                              mmap_threshold=mmap_threshold or None)
    if workload == "selection":
        table = Table(title=f"temporary memory of one layer's block selection ({device})")
        columns = ("config", "rss_temp_mib", "torch_peak_mib", "largest_mib", "projected_scores_mib", "seconds", "note")
        make_row = selection_row
    else:
        table = Table(title=f"peak memory of one training step ({device})")
        columns = ("config", "peak_gib", "step_gib", "projected_step_gib", "seconds", "note")
        make_row = result_row
    for col in columns:
        table.add_column(col, justify="right")
    for result in report["results"]:
        row = make_row(result)
        table.add_row(*("-" if row[c] is None else str(row[c]) for c in columns))
    console.print(table)
    console.print(f"wrote {out}")


@bench_app.command("real")
@user_errors
def real(
    model: Path = typer.Option(Path("runs/smollm2"), "--model", help="Real checkpoint folder (`sbft init-model smollm2 DIR`)."),
    out: Path = typer.Option(Path("bench_results/real"), "--out", help="Folder for real.json."),
    quick: bool = typer.Option(False, "--quick", help="Smaller sizes: about ten minutes on two CPU cores."),
    sections: str = typer.Option(
        "selection,passkey,densities,finetune", "--sections", help="Sections to run; others already in real.json are kept."
    ),
    work: Path = typer.Option(Path("runs/bench-real"), "--work", help="Fine-tune runs and their data."),
    density_docs: Optional[int] = typer.Option(None, "--density-docs", min=1, help="Documents per kind for `densities`."),
    density_max_tokens: Optional[int] = typer.Option(None, "--density-max-tokens", min=256, help="Longest document for `densities`."),
    density_time_limit: Optional[float] = typer.Option(None, "--density-time-limit", min=1, help="Stop `densities` after this many seconds."),
) -> None:
    """The sparse attention on a real pretrained model: selection curves, passkey, per-document densities, fine-tune."""
    from sparsebalance_ft.bench.real import RealPlan, run_real_bench

    names = [name.strip() for name in sections.split(",") if name.strip()]
    plan = RealPlan.make(quick)
    plan.density_docs_per_kind = density_docs or plan.density_docs_per_kind
    plan.density_max_tokens = density_max_tokens or plan.density_max_tokens
    plan.density_time_limit_s = density_time_limit or plan.density_time_limit_s
    run_real_bench(model, out, names, plan, work, say=lambda line: console.print(line, highlight=False))
    console.print(f"wrote {out / 'real.json'}")


@bench_app.command("heldout")
@user_errors
def heldout(
    recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="Recipe of the training run."),
    run: Optional[Path] = typer.Option(None, "--run", help="Training output folder (its adapter/); none: base model only."),
    heldout_glob: str = typer.Option("email/*.py", "--heldout-glob", help="Documents under data.path that training did not read."),
    docs: int = typer.Option(4, "--docs", min=1, help="Held-out documents."),
    tokens: int = typer.Option(1024, "--tokens", min=16, help="Tokens per held-out document."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key."),
) -> None:
    """Held-out loss before and after fine-tuning, with dense and with sparse attention at the recipe's budget."""
    from sparsebalance_ft.bench.real_heldout import heldout_documents, heldout_losses
    from sparsebalance_ft.errors import UserError
    from sparsebalance_ft.recipe import load_recipe
    from sparsebalance_ft.train.model import load_tokenizer

    recipe = load_recipe(recipe_path, overrides or [])
    adapter = None if run is None else run / "adapter"
    if adapter is not None and not (adapter / "adapter_config.json").is_file():
        raise UserError(f"--run: no trained adapter in {adapter}")
    documents = heldout_documents(recipe, load_tokenizer(recipe), heldout_glob, docs, tokens)
    with console.status(f"held-out loss on {len(documents)} documents ({heldout_glob})"):
        result = heldout_losses(recipe, adapter, documents)
    table = Table(title=f"held-out loss, {result['documents']} documents ({heldout_glob}), {result['tokens']} tokens; "
                        f"sparse at budget {result['budget']:g}")
    for col in ("model", "dense", "sparse", "sparse vs dense", "density", "recall"):
        table.add_column(col, justify="right")
    f = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    for name in ("base", "tuned"):
        if name in result:
            r = result[name]
            table.add_row(name, f(r["dense"]), f(r["sparse"]), f"{r['sparse_vs_dense']:+.1%}", f(r["density"]),
                          f(r["sampled_recall"]))
    console.print(table)
    if "tuned" in result:
        change = result["tuned"]["dense"] - result["base"]["dense"]
        console.print(f"fine-tuning changed the dense held-out loss by {change:+.3f} nats/token "
                      f"({result['base']['dense']:.3f} -> {result['tuned']['dense']:.3f})", highlight=False)
    if run is not None:
        (run / "heldout.json").write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {run / 'heldout.json'}")


@bench_app.command("extend")
@user_errors
def extend(
    recipe_path: Path = typer.Argument(Path("recipes/extend-smollm2.yaml"), metavar="RECIPE", help="The extension job."),
    out: Path = typer.Option(Path("bench_results/extend"), "--out", help="Folder for extend.json and the PNGs."),
    work: Path = typer.Option(Path("runs/bench-extend"), "--work", help="Training documents, runs and adapters."),
    sections: str = typer.Option("before,finetune,after", "--sections", help="Sections to run; others in extend.json are kept."),
    device: str = typer.Option("cuda", "--device", help="cpu or cuda (evaluation; training runs where accelerate puts it)."),
    quick: bool = typer.Option(False, "--quick", help="The tiny model, 256 native positions trained at 512: the plumbing in seconds."),
    cpu_plan: bool = typer.Option(False, "--cpu-plan", help="Sizes two CPU cores allow (a few 16K steps, evaluation to 16K)."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Training steps per arm."),
    eval_lengths: Optional[str] = typer.Option(None, "--eval-lengths", help="Held-out lengths, comma-separated."),
    passkey_lengths: Optional[str] = typer.Option(None, "--passkey-lengths", help="Passkey prompt lengths, comma-separated."),
    trials: Optional[int] = typer.Option(None, "--trials", min=1, help="Passkey prompts per (length, depth)."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key (e.g. model.path=...)."),
) -> None:
    """Context extension: untrained scalings, a dense and a sparse fine-tune on one data order, both evaluated after."""
    from sparsebalance_ft.bench.extend import ExtendPlan, run_extend_bench
    from sparsebalance_ft.errors import UserError

    if device not in ("cpu", "cuda"):
        raise UserError(f"--device: expected cpu or cuda, got {device!r}")
    plan = ExtendPlan.make_quick(device) if quick else (ExtendPlan.cpu() if cpu_plan else ExtendPlan(device=device))
    plan.device = device
    plan.steps = steps or plan.steps
    plan.passkey_trials = trials or plan.passkey_trials
    if eval_lengths:
        plan.eval_lengths = [int(x) for x in _floats(eval_lengths, "eval-lengths")]
    if passkey_lengths:
        plan.passkey_lengths = [int(x) for x in _floats(passkey_lengths, "passkey-lengths")]
    names = [name.strip() for name in sections.split(",") if name.strip()]
    result = run_extend_bench(recipe_path, out, work, names, plan, overrides or [],
                              say=lambda line: console.print(line, highlight=False))
    summary = result.get("summary", {})
    for key, value in summary.items():
        if key != "targets":
            console.print(f"  {key}: {value:.4f}" if isinstance(value, float) else f"  {key}: {value}", highlight=False)
    for name, ok in summary.get("targets", {}).items():
        console.print(f"  target {name}: {'met' if ok else 'MISSED'}", highlight=False)
    console.print(f"wrote {out / 'extend.json'}")


@bench_app.command("step")
@user_errors
def step(
    recipe_path: Path = typer.Option(Path("recipes/bench-step.yaml"), "--recipe", help="Recipe of the step (LoRA, checkpointing, loss)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Checkpoint folder (default runs/smollm2; --quick: a tiny model in --work)."),
    lengths: Optional[str] = typer.Option(None, help="Comma-separated tokens per step (default 4096,8192,16384,32768; --quick 512)."),
    arms: str = typer.Option(",".join(("dense", "0.3", "0.5", "0.7", "1.0")), help="dense and sparse budgets, comma-separated."),
    repeats: Optional[str] = typer.Option(None, help="Timed repeats per arm: one count, or one per length (default 3; --quick 1)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    backend: str = typer.Option("auto", help="Sparse kernel: auto, torch, flex or triton."),
    dtype: str = typer.Option("auto", help="Weights dtype: auto (float32 on CPU, bf16 on a GPU), float32, bfloat16, float16."),
    quick: bool = typer.Option(False, "--quick", help="The tiny model at 512 tokens, one repeat (seconds)."),
    loss_only: bool = typer.Option(False, "--loss-only", help="Each arm's loss, gap to dense and kept density from one forward per length (no backward, no timing, no repeats)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results as JSON, the PNG beside it (default bench_results/step/step.json; --loss-only step-loss.json)."),
    work: Path = typer.Option(Path("runs/bench-step"), "--work", help="Where --quick puts its tiny model."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key."),
) -> None:
    """A whole LoRA training step (as `sbft train` runs it), dense SDPA against the sparse attention per budget:
    step time, speedup, loss gap, kept density, memory, the Amdahl ceiling and where the sparse step's time goes."""
    from sparsebalance_ft.bench.step import StepPlan, run_loss_bench, run_step_bench
    from sparsebalance_ft.bench.step_report import loss_table_markdown, step_table_markdown

    if model is None:
        if quick:
            from sparsebalance_ft.modeling.tiny import init_tiny

            model = work / "tiny-llama"
            if not (model / "config.json").is_file():
                init_tiny(model)
        else:
            model = Path("runs/smollm2")
    lens = [int(x) for x in _floats(lengths or ("512" if quick else "4096,8192,16384,32768"), "lengths")]
    counts = [int(x) for x in _floats(repeats or ("1" if quick else "3"), "repeats")]
    plan = StepPlan(lengths=lens, arms=[a.strip() for a in arms.split(",") if a.strip()], repeats=counts,
                    device=device, backend=backend, dtype=dtype)
    out = out or Path("bench_results/step") / ("step-loss.json" if loss_only else "step.json")
    say = lambda line: console.print(line, highlight=False)  # noqa: E731
    if loss_only:
        result = run_loss_bench(recipe_path, model, plan, out, overrides or [], say=say)
        console.print(loss_table_markdown(result), highlight=False)
        console.print(f"wrote {out}")
        return
    result = run_step_bench(recipe_path, model, plan, out, overrides or [], say=say)
    console.print(step_table_markdown(result), highlight=False)
    console.print(f"wrote {out} and {out.with_suffix('.png')}")


@bench_app.command("long-densities")
@user_errors
def long_densities(
    model: Path = typer.Option(Path("runs/smollm2"), "--model", help="Real checkpoint folder (`sbft init-model smollm2 DIR`)."),
    lengths: str = typer.Option("16384,32768", "--lengths", help="Document lengths in tokens, comma-separated."),
    docs: str = typer.Option("2,1", "--docs", help="Documents per kind at each length (one number, or one per length)."),
    rope_factor: Optional[float] = typer.Option(None, "--rope-factor", help="Linear RoPE factor [default: longest length / native positions]."),
    time_limit: Optional[float] = typer.Option(None, "--time-limit", min=1, help="Stop after this many seconds (later lengths are cut first)."),
    out: Path = typer.Option(Path("bench_results/long-densities/densities.json"), "--out", help="JSON to write (`sbft simulate --density-from` reads it)."),
    append: bool = typer.Option(False, "--append", help="Keep the rows of an existing --out and measure only the documents it lacks."),
) -> None:
    """Per-document kept density past the native length, by kind of text (forward only, default budget)."""
    from sparsebalance_ft.bench.long_densities import long_densities as measure
    from sparsebalance_ft.errors import UserError

    lens = [int(x) for x in _floats(lengths, "lengths")]
    counts = [int(x) for x in _floats(docs, "docs")]
    counts = counts * len(lens) if len(counts) == 1 else counts
    if len(counts) != len(lens) or min(counts) < 1:
        raise UserError(f"--docs {docs!r}: one positive count, or one per length ({len(lens)})")
    native = _native_positions(model)
    factor = rope_factor or max(lens) / native
    previous = json.loads(out.read_text()) if append and out.is_file() else None
    result = measure(model, lens, counts, factor, time_limit=time_limit,
                     say=lambda line: console.print(line, highlight=False), previous=previous)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    table = Table(title=f"kept density at budget {result['densities']['budget']:g}, {result['densities']['model']}")
    for col in ("tokens", *result["densities"]["summary"]["by_kind"]):
        table.add_column(col, justify="right")
    for length, summary in result["densities"]["by_length"].items():
        cells = [summary["by_kind"][k] for k in summary["by_kind"]]
        table.add_row(length, *(f"{c['mean']:.3f} (n={c['n']})" if c["n"] else "-" for c in cells))
    console.print(table)
    console.print(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
