"""Where a training step's time goes, measured inside the real step (`sbft bench step`).

`StepProbe` times, during an ordinary `run_local_step`, without changing what it computes:

- the attention calls (`attention_forward`, `attention_recompute`: the forward a gradient-checkpoint
  recompute runs again inside the backward, and `attention_backward`). The model runs a registered
  wrapper of its attention (`timed_attention`) that marks the call's start and end and puts an identity
  autograd node on its inputs and one on its output: the output's node runs when the attention's
  backward starts, the inputs' node when it has finished (autograd runs the nodes created between them,
  the attention's own, in between);
- inside the sparse attention (`instrument_sparse_attention`): the block selection with its kernel plan
  (`selection`), the kernel's forward and backward outside recomputation (`kernel_forward`,
  `kernel_backward`; the full-budget route's fused SDPA counts as the kernel), and the attention report's
  bookkeeping (`report`: sampled recall, per-document counts; the step adds its `pop_report`);
- each decoder layer's recomputation under gradient checkpointing (`recompute`), by wrapping the
  function each layer checkpoints (its end is the moment recomputation stops, early stop included);
- host synchronisations: on CUDA every synchronising call that `torch.cuda.set_sync_debug_mode` flags
  (reads of values, data-dependent shapes); on CPU, where nothing is asynchronous, every Python-level read
  of a tensor's value (`item`, `tolist`, `bool`, `int`, `float`, `numpy`): the calls that would
  synchronise on a GPU. Both counted in all and inside attention calls.

Marks are `time.perf_counter()` on CPU (each op blocks) and CUDA events on a GPU (no synchronisation:
intervals are read after the step's final synchronize), so the probe does not slow the timed step.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from collections import defaultdict
from typing import Callable, Iterator

import torch

from ..attention import register as sparse_register
from ..attention.register import in_backward

SPANS = ("attention_forward", "attention_recompute", "attention_backward", "selection", "kernel_forward",
         "kernel_backward", "recompute", "report")
_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__")
_SYNC_WARNING = "called a synchronizing CUDA operation"


class StepProbe:
    """Time spans and host-synchronisation counts of one step at a time (`begin`, then `finish`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._spans: dict[str, list] = defaultdict(list)
        self._open: dict[str, list] = defaultdict(list)
        self.attention_depth = 0
        self.syncs = 0
        self.attention_syncs = 0

    # -- marks --------------------------------------------------------------------------------------
    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def span(self, name: str, start, end) -> None:
        self._spans[name].append((start, end))

    def open_backward(self, name: str) -> None:
        self._open[name].append(self.mark())

    def close_backward(self, name: str) -> None:
        if self._open[name]:
            self.span(name, self._open[name].pop(), self.mark())

    def count_sync(self) -> None:
        self.syncs += 1
        if self.attention_depth:
            self.attention_syncs += 1

    # -- one step -----------------------------------------------------------------------------------
    def begin(self) -> None:
        self._spans.clear()
        self._open.clear()
        self.syncs = self.attention_syncs = 0

    def finish(self) -> dict[str, float]:
        """Seconds per span name (call after the step's final synchronize)."""
        out = {}
        for name in SPANS:
            pairs = self._spans.get(name, [])
            if self.cuda:
                out[name] = sum(a.elapsed_time(b) for a, b in pairs) / 1000.0
            else:
                out[name] = float(sum(b - a for a, b in pairs))
        return out


class _InputsDone(torch.autograd.Function):
    """Identity on a region's inputs; its backward runs once the region's backward has finished."""

    @staticmethod
    def forward(ctx, probe, name, *xs):
        ctx.probe, ctx.name = probe, name
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.probe.close_backward(ctx.name)
        return (None, None, *grads)


class _OutputReached(torch.autograd.Function):
    """Identity on a region's output; its backward runs when the region's backward starts."""

    @staticmethod
    def forward(ctx, probe, name, x):
        ctx.probe, ctx.name = probe, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.probe.open_backward(ctx.name)
        return None, None, grad


def timed_region(probe: StepProbe, forward_name: str, backward_name: str, run: Callable, *tensors,
                 recompute_name: str | None = None):
    """`run(*tensors)` with its forward timed as `forward_name` (or `recompute_name` inside a backward) and its
    backward as `backward_name`. Tensors that need no gradient pass through untouched."""
    recompute = in_backward()
    track = not recompute and any(t.requires_grad for t in tensors) and torch.is_grad_enabled()
    if track:
        tensors = _InputsDone.apply(probe, backward_name, *tensors)
    start = probe.mark()
    out = run(*tensors)
    name = recompute_name if recompute else forward_name
    if name is not None:
        probe.span(name, start, probe.mark())
    if track:
        out = _OutputReached.apply(probe, backward_name, out)
    return out


def timed_attention(probe: StepProbe, attention: Callable) -> Callable:
    """A transformers attention function that runs `attention` under the probe (spans and sync attribution)."""

    def forward(module, query, key, value, attention_mask, **kwargs):
        probe.attention_depth += 1
        try:
            holder = {}

            def run(q, k, v):
                out, holder["weights"] = attention(module, q, k, v, attention_mask, **kwargs)
                return out

            out = timed_region(probe, "attention_forward", "attention_backward", run, query, key, value,
                               recompute_name="attention_recompute")
            return out, holder["weights"]
        finally:
            probe.attention_depth -= 1

    return forward


@contextlib.contextmanager
def instrument_sparse_attention(probe: StepProbe) -> Iterator[None]:
    """Time the sparse attention's selection and kernel (forward and backward) while the block runs."""
    choose, kernel, dense = sparse_register._choose_route, sparse_register.block_sparse_attention, sparse_register._dense_docs
    recall, per_document = sparse_register.sampled_recall_tensor, sparse_register._per_document

    def timed(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            start = probe.mark()
            try:
                return fn(*args, **kwargs)
            finally:
                probe.span(name, start, probe.mark())
        return call

    def timed_kernel(inner):
        def call(q, k, v, *args, **kwargs):
            return timed_region(probe, "kernel_forward", "kernel_backward",
                                lambda q_, k_, v_: inner(q_, k_, v_, *args, **kwargs), q, k, v)
        return call

    sparse_register._choose_route = timed("selection", choose)
    sparse_register.block_sparse_attention = timed_kernel(kernel)
    sparse_register._dense_docs = timed_kernel(dense)
    sparse_register.sampled_recall_tensor = timed("report", recall)
    sparse_register._per_document = timed("report", per_document)
    try:
        yield
    finally:
        sparse_register._choose_route, sparse_register.block_sparse_attention = choose, kernel
        sparse_register._dense_docs = dense
        sparse_register.sampled_recall_tensor, sparse_register._per_document = recall, per_document


@contextlib.contextmanager
def timed_recompute(probe: StepProbe, layers) -> Iterator[None]:
    """Time each decoder layer's gradient-checkpoint recomputation (the checkpointed function called again
    inside the backward) while the block runs."""
    saved = []
    for layer in layers:
        checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
        if checkpoint is None:
            continue

        def wrapped(fn, *args, _checkpoint=checkpoint, **kwargs):
            def run(*a, **k):
                if not in_backward():
                    return fn(*a, **k)
                start = probe.mark()
                try:
                    return fn(*a, **k)
                finally:  # early stop ends the recomputation with an exception once it has what backward needs
                    probe.span("recompute", start, probe.mark())
            return _checkpoint(run, *args, **kwargs)

        saved.append((layer, checkpoint))
        layer._gradient_checkpointing_func = wrapped
    try:
        yield
    finally:
        for layer, checkpoint in saved:
            layer._gradient_checkpointing_func = checkpoint


@contextlib.contextmanager
def counted_syncs(probe: StepProbe) -> Iterator[str]:
    """Count host synchronisations while the block runs; yields how they are counted (for the report)."""
    if probe.cuda:
        previous = torch.cuda.get_sync_debug_mode()
        show = warnings.showwarning

        def on_warning(message, category, filename, lineno, file=None, line=None):
            if _SYNC_WARNING in str(message):
                probe.count_sync()
            else:
                show(message, category, filename, lineno, file, line)

        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=f".*{_SYNC_WARNING}.*")
            warnings.showwarning = on_warning
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield "torch.cuda.set_sync_debug_mode('warn'): every synchronising CUDA call"
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        return
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(original):
        def read(self, *args, **kwargs):
            probe.count_sync()
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        yield ("Python-level reads of tensor values (item, tolist, numpy, bool, int, float): "
               "each a device synchronisation on a GPU; CPU ops never wait")
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
