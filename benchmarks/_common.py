"""Shared helpers of the benchmark scripts: timing, peak memory, tables."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = [
    "bench_args", "fmt_ratio", "fmt_table", "host_waits_of", "interleaved_medians",
    "interleaved_times", "median_seconds", "paired_ratio", "peak_extra_bytes", "sync",
    "vllm_loader",
]


def bench_args(
    description: str, argv=None, *, big: str | None = None
) -> tuple[torch.device, int, bool]:
    """The options every benchmark takes: ``(device, repeats, quick)``, and ``--threads
    N``, which sets torch's thread count; with ``big`` (its help text), also a ``--big``
    switch, whose value comes fourth."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke run)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch's thread count for the run (default: torch's own)")
    if big is not None:
        ap.add_argument("--big", action="store_true", help=big)
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    out = torch.device(args.device), (1 if args.quick else args.repeats), args.quick
    return (*out, args.big) if big is not None else out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_times(
    fns: Sequence[Callable[[], object]], device: torch.device, repeats: int, *, seed: int = 0
) -> list[list[float]]:
    """Wall times of each of ``fns`` over ``repeats`` rounds, after one warm-up run each
    (``out[i][r]``: function ``i`` in round ``r``). A round runs every function once, in
    an order shuffled anew each round (seeded: the same for every run), so that a shared
    machine's drift (other tenants, page-cache and allocator state) and the traces one
    function leaves for the next (a warm cache, a full one) fall on all of them alike.
    Each timed call starts after a full garbage collection, so that no garbage of earlier
    calls is collected inside one (the young generation's collections that a call's own
    allocations set off still run in it: cheap); the collection also leaves the caches
    cold, so a small load times at two to three times what it takes in a tight loop (a
    plain load of 1 M bf16 elements: 0.6-0.7 ms against 0.2-0.3 ms), which is closer to
    a training loop, where the trainer's own work has filled the caches between two
    loads."""
    for fn in fns:
        fn()
    sync(device)
    order = list(range(len(fns)))
    rng = random.Random(seed)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        rng.shuffle(order)
        for i in order:
            gc.collect()
            sync(device)
            t0 = time.perf_counter()
            fns[i]()
            sync(device)
            times[i].append(time.perf_counter() - t0)
    return times


def interleaved_medians(
    fns: Sequence[Callable[[], object]], device: torch.device, repeats: int
) -> list[float]:
    """The median of each function's times in :func:`interleaved_times`."""
    return [statistics.median(t) for t in interleaved_times(fns, device, repeats)]


def paired_ratio(times: Sequence[float], base: Sequence[float]) -> tuple[float, float, float]:
    """``(median, lower quartile, upper quartile)`` of the round-by-round ratios
    ``times[r] / base[r]`` of two functions timed in the same rounds. Steadier than the
    ratio of their medians on a machine whose speed drifts: a slow spell slows both
    loads of a round."""
    ratios = sorted(t / b for t, b in zip(times, base))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), q[0], q[-1]


def fmt_ratio(times: Sequence[float], base: Sequence[float], *, spread: bool = False) -> str:
    """:func:`paired_ratio` as ``"1.37x"``, or with ``spread`` ``"1.37x (1.30-1.45)"``
    (the rounds' ratios' quartiles, by ``statistics.quantiles``' default method: with 5
    rounds, halfway between the two lowest ratios and between the two highest)."""
    mid, lo, hi = paired_ratio(times, base)
    return f"{mid:.2f}x ({lo:.2f}-{hi:.2f})" if spread else f"{mid:.2f}x"


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs, after one warm-up run."""
    return interleaved_medians([fn], device, repeats)[0]


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated by ``fn`` above what was allocated when it started.

    CUDA: the caching allocator's peak counter. CPU: the profiler's allocation and free
    events, replayed in time order (the profiler slows the run, so this is measured in a
    separate run from the timing).
    """
    gc.collect()
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with _without_profiler_notices(), profile(
        activities=[ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


# ATen ops whose result the host reads, or whose result's size the host must know
# (so on CUDA each waits for the GPU); nested ones count once, with their outermost op.
_WAITING_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal",
    "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::bincount",
    "aten::repeat_interleave",
})


def host_waits_of(fn: Callable[[], object]) -> int:
    """How many times ``fn`` makes the host wait for a device: the ATen ops of
    ``_WAITING_OPS`` it runs (``int(t)``, ``bool(t)``, boolean-mask indexing, ...), its
    ``Tensor.tolist`` calls, and the device synchronizes a report makes before and after
    each ``load_weights`` call (``patchkit.intercept._wait_for``: one per call of it, as
    on a model on one GPU). Counted on any device (on the CPU nothing waits, but the same
    calls would on a GPU); deterministic, unlike a timing. Not counted: copies of a
    device tensor to the CPU (``.cpu()``, ``.to("cpu")``), which on the CPU cannot be
    told from other copies."""
    from torch.profiler import ProfilerActivity, profile

    from patchkit import intercept

    calls = [0]
    tolist = torch.Tensor.tolist
    wait_for = intercept._wait_for

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return tolist(self, *args, **kwargs)

    def counted_wait(*args, **kwargs):
        calls[0] += 1
        return wait_for(*args, **kwargs)

    own = "tolist" in torch.Tensor.__dict__  # (else inherited from torch._C.TensorBase)
    torch.Tensor.tolist = counted
    intercept._wait_for = counted_wait
    try:
        with _without_profiler_notices(), profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        intercept._wait_for = wait_for
        if own:
            torch.Tensor.tolist = tolist
        else:
            del torch.Tensor.tolist
    waits = 0
    for e in prof.events():
        if e.name not in _WAITING_OPS:
            continue
        up = e.cpu_parent
        while up is not None and up.name not in _WAITING_OPS:
            up = up.cpu_parent
        waits += up is None
    return waits + calls[0]


@contextlib.contextmanager
def _without_profiler_notices() -> Iterator[None]:
    """Run the block with the process's stderr captured, then write back every line but
    the profiler's own start/stop notices (``USDT: ... profiler_start``, written by
    torch's C++ side straight to file descriptor 2 each time a profile starts or stops)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().splitlines(keepends=True)
                    if not (ln.startswith(b"USDT:") and b"profiler_st" in ln)]
            if kept:
                sys.stderr.buffer.write(b"".join(kept))
                sys.stderr.flush()


def vllm_loader() -> Callable | None:
    """vLLM's ``load_checkpoint_weight_patches`` when vLLM is importable, else None."""
    try:
        mod = importlib.import_module("vllm.model_executor.model_loader.checkpoint_weight_patch")
    except Exception:
        return None
    return getattr(mod, "load_checkpoint_weight_patches", None)


def fmt_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text (Markdown-compatible) table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
        if k == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
