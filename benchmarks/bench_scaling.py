"""How a report's cost grows with the number of small writes a loader makes.

A report is meant to cost about what its writes cost, whatever their number: no step of it
may look at every earlier write again for each new one (which is quadratic, and is what
each case below once did). Each case runs at a size ``n`` and at ``2n`` and prints, next to
the plain load of the same patches (the baseline, in the same run):

- **rows, strided**: two parameters that are column slices of one buffer (a fused
  weight), written a row at a time by ``load_weights`` (``n`` rows each); the report, its
  ``deltas``, and ``before()``, ``written()`` and ``plot_delta``'s reader of one slice;
- **rows twice, reads**: one parameter whose ``n`` rows are each written twice (a save per
  row per pass, overlapping); the report and its reader, read a block of 64 rows at a time
  as ``plot_delta`` reads;
- **rows, observed, raises**: the same model, whose ``load_weights`` raises after its
  writes, run through ``inspect_load(..., loader=load_checkpoint_weight_patches)`` (an
  observed loader: what it left written is found after the error);
- **rebinds, one per call**: ``n`` small parameters that ``load_weights`` rebinds
  (``param.data = w``), one per call (``max_chunk_bytes`` of one patch).

"growth" is the report's time at ``2n`` over its time at ``n``: about 2x for work in
proportion to the writes; 4x is quadratic. A report's time per write is Python's (a
few microseconds to a millisecond: see ``docs/inspection.md``, "Time"), so the ratio to
the plain load is high here by design; what this table watches is the growth.

Usage: ``python benchmarks/bench_scaling.py [--quick] [--repeats N] [--threads N]`` (CPU:
the loads are Python-bound, and the models are made on the CPU).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import bench_args, fmt_table, interleaved_times

import patchkit
from patchkit import CheckpointWeightPatch


class _ColumnSlices(torch.nn.Module):
    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        base = torch.zeros(rows, 2 * cols)
        self.a = torch.nn.Parameter(base[:, :cols], requires_grad=False)
        self.b = torch.nn.Parameter(base[:, cols:], requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            dst = getattr(self, name).data
            for r in range(dst.shape[0]):
                dst[r].copy_(w[r])
        return {n for n, _ in weights}


class _RowsTwice(torch.nn.Module):
    def __init__(self, rows: int, cols: int, fail: bool = False) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(rows, cols), requires_grad=False)
        self.fail = fail

    def load_weights(self, weights):
        for _, w in weights:
            for step in (0.0, 1.0):
                for r in range(self.w.shape[0]):
                    self.w.data[r].copy_(w[r] + step)
        if self.fail:
            raise RuntimeError("the model failed after its writes")
        return {n for n, _ in weights}


class _Rebinds(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        for i in range(n):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(4, 4),
                                                                 requires_grad=False))

    def load_weights(self, weights):
        for name, w in weights:
            getattr(self, name).data = w.clone()
        return {n for n, _ in weights}


def _values(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _strided(n: int):
    cols = 64
    patches = [CheckpointWeightPatch(x, (n, cols), torch.float32, _values(n * cols, k))
               for k, x in enumerate("ab")]

    def plain():
        patchkit.load_checkpoint_weight_patches(_ColumnSlices(n, cols), patches)

    def report():
        r = patchkit.inspect_load(_ColumnSlices(n, cols), patches)
        r.deltas  # noqa: B018 (built on first read)
        r.before("a"), r.written("a"), r._before_after("a")

    return plain, report


def _twice_reads(n: int):
    cols = 64
    patches = [CheckpointWeightPatch("w", (n, cols), torch.float32, _values(n * cols, 0))]

    def plain():
        patchkit.load_checkpoint_weight_patches(_RowsTwice(n, cols), patches)

    def report():
        r = patchkit.inspect_load(_RowsTwice(n, cols), patches)
        reader = r._before_after("w")
        step = 64 * cols
        for lo in range(0, n * cols, step):
            reader.read(lo, min(n * cols, lo + step))

    return plain, report


def _observed_raises(n: int):
    cols = 64
    patches = [CheckpointWeightPatch("w", (n, cols), torch.float32, _values(n * cols, 0))]

    def plain():
        with contextlib.suppress(RuntimeError):  # (the model's own error)
            patchkit.load_checkpoint_weight_patches(_RowsTwice(n, cols, fail=True), patches)

    def report():
        with contextlib.suppress(RuntimeError):
            patchkit.inspect_load(_RowsTwice(n, cols, fail=True), patches,
                                  loader=patchkit.load_checkpoint_weight_patches)

    return plain, report


def _rebinds(n: int):
    patches = [CheckpointWeightPatch(f"p{i}", (4, 4), torch.float32, _values(16, i))
               for i in range(n)]

    def plain():
        patchkit.load_checkpoint_weight_patches(_Rebinds(n), patches, max_chunk_bytes=64)

    def report():
        patchkit.inspect_load(_Rebinds(n), patches, max_chunk_bytes=64).deltas  # noqa: B018

    return plain, report


def main(argv=None) -> int:
    device, repeats, quick = bench_args(__doc__.splitlines()[0], argv)
    cpu = torch.device("cpu")
    cases = [("rows, strided", _strided, 64 if quick else 512),
             ("rows twice, reads", _twice_reads, 256 if quick else 4096),
             ("rows, observed, raises", _observed_raises, 64 if quick else 512),
             ("rebinds, one per call", _rebinds, 64 if quick else 1000)]
    rows = []
    for label, make, n in cases:
        medians = {}
        for size in (n, 2 * n):
            plain, report = make(size)
            t_plain, t_report = (statistics.median(t) for t in
                                 interleaved_times([plain, report], cpu, repeats))
            medians[size] = t_report
            rows.append([label, size, f"{t_plain * 1e3:.1f}", f"{t_report * 1e3:.1f}",
                         f"{t_report / t_plain:.1f}x",
                         f"{t_report / medians[n]:.2f}x" if size == 2 * n else "-"])
    print(f"how a report's cost grows with its writes (CPU, torch threads: "
          f"{torch.get_num_threads()}; median of {repeats}; growth: report ms at 2n over n)")
    print(fmt_table(["case", "n", "plain ms", "report ms", "report / plain", "growth"], rows))
    if device.type != "cpu":
        print(f"(--device {device} ignored: these loads run on the CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
