"""The Triton kernels compiled for GPUs this machine does not have: shared memory, registers and spills.

Why: a GPU is lent here for minutes, rarely, and under ``TRITON_INTERPRET=1`` the tests check what the kernels
compute but never lower them: a tile that no GPU compiles, or whose shared memory is over a card's limit, would
first fail there (one did: fp32 128 x 128 tiles in the backward, OutOfResources on an H200). Triton compiles
for an explicit target without a driver (TTIR, TTGIR, LLVM IR, PTX, then a cubin from the ptxas it ships), so
each kernel is compiled here at the settings its wrapper launches with (`kernel_constexprs` in
kernels/triton.py and kernels/sampled_mass.py) and at each pipelining depth `launch` tries, deepest first, until
one fits the target's shared memory per block. ptxas reports registers per thread and spilled bytes: a spill
puts part of a tile in local memory, the first thing to look at when a kernel runs slow.

    .venv/bin/python -m sparsebalance_ft.bench.triton_compile --out bench_results/gpu/triton-compile.json
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from sparsebalance_ft.attention.kernels import sampled_mass
from sparsebalance_ft.attention.kernels import triton as attention
from sparsebalance_ft.attention.kernels.triton import PIPELINE_STAGES, TRITON_AVAILABLE


@dataclass(frozen=True)
class Target:
    """A GPU generation: its compute capability and the shared memory one block may opt into (what triton
    compares a kernel's with before launching it)."""

    name: str
    capability: int
    shared_bytes: int


TARGETS = {
    "a100": Target("A100 (sm_80)", 80, 166912),
    "l40s": Target("L40S / RTX 4090 (sm_89)", 89, 101376),
    "h100": Target("H100 / H200 (sm_90a)", 90, 232448),
}
_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Pointer arguments by name, as the kernels call them: in the model's dtype, fp32, or int32 indices. Scalars are
# fp32 (scales) or int32 (sizes, offsets, the window). The sampled-mass kernel writes fp32 shares to `Out`.
_MODEL_POINTERS = {"Q", "K", "V", "Out", "DO", "DQ", "DK", "DV"}
_FP32_POINTERS = {"LSE", "DELTA"}
_INT32_POINTERS = {"IDX", "CNT", "TPTR", "TIDX", "QPOS", "LO", "TOKENS"}
_FP32_SCALARS = {"scale", "qk_scale"}
_INT32_SCALARS = {"window", "L", "NQ", "NK", "KMAX", "C", "I0", "K0"}


def signature(kernel, dtype: torch.dtype, fp32_out: bool = False) -> dict[str, str]:
    """Triton's type string for each of `kernel`'s arguments when q, k, v are `dtype`; constexprs by name."""
    types = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            types[name] = "constexpr"
        elif (name == "Out" and fp32_out) or name in _FP32_POINTERS:
            types[name] = "*fp32"
        elif name in _MODEL_POINTERS:
            types[name] = "*" + _TRITON_DTYPES[dtype]
        elif name in _INT32_POINTERS:
            types[name] = "*i32"
        elif name in _FP32_SCALARS:
            types[name] = "fp32"
        elif name in _INT32_SCALARS:
            types[name] = "i32"
        else:
            raise KeyError(f"{kernel.__name__}: no type known for argument {name!r}")
    return types


def kernels_at(dtype: torch.dtype, block_size: int, head_dim: int, group: int, per_block: int) -> list[tuple]:
    """(name, kernel, signature, settings) of every kernel a training step launches for these shapes: the
    attention's forward and its three backward kernels, and the selection's sampled-mass kernel."""
    common = attention.kernel_constexprs(group, block_size, head_dim, None, dtype)
    delta = attention.delta_constexprs(common)
    sampled = sampled_mass.kernel_constexprs(group, per_block, block_size, head_dim, None, dtype)
    return [
        ("forward", attention._fwd_kernel, signature(attention._fwd_kernel, dtype), common),
        ("delta", attention._delta_kernel, signature(attention._delta_kernel, dtype), delta),
        ("dq", attention._dq_kernel, signature(attention._dq_kernel, dtype), common),
        ("dkdv", attention._dkdv_kernel, signature(attention._dkdv_kernel, dtype), common),
        ("sampled_mass", sampled_mass._sampled_mass_kernel,
         signature(sampled_mass._sampled_mass_kernel, dtype, fp32_out=True), sampled),
    ]


def compile_for(kernel, types: dict[str, str], settings: dict, capability: int, stages: int) -> dict:
    """Compile one kernel for `capability` at `stages`: its shared memory, and ptxas's registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {"num_warps": settings["num_warps"], "num_stages": stages}
    constexprs = {name: value for name, value in settings.items() if name != "num_warps"}
    log = io.StringIO()
    start = time.perf_counter()
    with _ptxas_log(), contextlib.redirect_stdout(log), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # triton 3.9's notice that its fp-fusion default will change
        compiled = triton.compile(ASTSource(fn=kernel, signature=types, constexprs=constexprs),
                                  target=GPUTarget("cuda", capability, 32), options=options)
    registers = re.findall(r"Used (\d+) registers", log.getvalue())
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
    return {"shared_bytes": compiled.metadata.shared, "registers": int(registers[-1]) if registers else None,
            "spill_store_bytes": int(spills[-1][0]) if spills else None,
            "spill_load_bytes": int(spills[-1][1]) if spills else None,
            "compile_s": round(time.perf_counter() - start, 2)}


@contextlib.contextmanager
def _ptxas_log():
    """Have triton run ptxas even where its cache holds the kernel, and print ptxas's verbose log (registers,
    spills), which it otherwise deletes."""
    from triton import knobs

    before = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    knobs.nvidia.dump_ptxas_log = knobs.compilation.always_compile = True
    try:
        yield
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = before


def deepest_fitting(kernel, types: dict[str, str], settings: dict, target: Target) -> dict:
    """What `launch` does on `target`: the first of `PIPELINE_STAGES` whose shared memory the target holds.
    `stages` None: no depth fits (the figures are the shallowest's)."""
    for stages in PIPELINE_STAGES:
        result = compile_for(kernel, types, settings, target.capability, stages)
        if result["shared_bytes"] <= target.shared_bytes:
            return {"stages": stages, **result}
    return {"stages": None, **result}


def _other_warps(kernel, types: dict[str, str], settings: dict, target: Target, stages: int) -> dict:
    """A kernel that spills, compiled with 8 warps instead of 4 or 4 instead of 8: whether the other split of
    its tiles over threads spills less, a lead for tuning on a GPU (ptxas cannot say which runs faster)."""
    warps = {4: 8, 8: 4}[settings["num_warps"]]
    result = compile_for(kernel, types, {**settings, "num_warps": warps}, target.capability, stages)
    return {"num_warps": warps, **{key: result[key] for key in ("shared_bytes", "registers", "spill_store_bytes")}}


def measure(target: Target, kernel, types: dict[str, str], settings: dict) -> dict:
    """One kernel on one target: the depth `launch` would run it at and what it costs there, and for a kernel
    that spills, the same at the other warp count."""
    row = {"num_warps": settings["num_warps"], "shared_limit_bytes": target.shared_bytes,
           **deepest_fitting(kernel, types, settings, target)}
    if row["stages"] and row["spill_store_bytes"]:
        row["other_warps"] = _other_warps(kernel, types, settings, target, row["stages"])
    return row


def _line(target: Target, row: dict) -> str:
    other = row.get("other_warps")
    return (f"{target.name:<24} {row['dtype']} {row['block_size']:>3}x{row['head_dim']:<3} {row['kernel']:<12} "
            f"stages {row['stages']}  shared {row['shared_bytes']:>6} of {target.shared_bytes}  "
            f"registers {row['registers']}  spills {row['spill_store_bytes']} B"
            + (f" ({other['spill_store_bytes']} B at {other['num_warps']} warps)" if other else ""))


def run(targets: list[str], dtypes: list[torch.dtype], tiles: list[tuple[int, int]], group: int,
        per_block: int) -> dict:
    import triton

    rows = []
    for key, dtype, (block_size, head_dim) in itertools.product(targets, dtypes, tiles):
        for name, kernel, types, settings in kernels_at(dtype, block_size, head_dim, group, per_block):
            rows.append({"target": key, "dtype": _TRITON_DTYPES[dtype], "block_size": block_size, "head_dim": head_dim,
                         "kernel": name, **measure(TARGETS[key], kernel, types, settings)})
            print(_line(TARGETS[key], rows[-1]), flush=True)
    return {"setup": {"triton": triton.__version__, "torch": torch.__version__, "group": group,
                      "sampled_tokens_per_block": per_block, "pipeline_stages_tried": list(PIPELINE_STAGES),
                      "targets": {key: vars(TARGETS[key]) for key in targets}},
            "rows": rows, "fits_nowhere": [row for row in rows if row["stages"] is None]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"of {', '.join(TARGETS)}")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--tiles", default="64x64,64x128,128x128", help="block size x head dim")
    parser.add_argument("--group", type=int, default=3, help="query heads per key-value head (SmolLM2: 3)")
    parser.add_argument("--sampled", type=int, default=8, help="sampled query tokens per block (the default)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not TRITON_AVAILABLE:
        raise SystemExit("triton is not installed (pip install 'sparsebalance-ft[triton]')")
    tiles = [tuple(int(x) for x in tile.split("x")) for tile in args.tiles.split(",")]
    result = run(args.targets.split(","), [getattr(torch, name) for name in args.dtypes.split(",")], tiles,
                 args.group, args.sampled)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}; fits at no pipelining depth: "
          + (", ".join(f"{r['target']} {r['dtype']} {r['block_size']}x{r['head_dim']} {r['kernel']}"
                       for r in result["fits_nowhere"]) or "none"))


if __name__ == "__main__":
    main()
