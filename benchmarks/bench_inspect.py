"""What a report costs: ``inspect_load`` against a plain load of the same patches.

Prints two tables from one run:

1. time and peak extra memory of ``patchkit.inspect_load`` next to
   ``patchkit.load_checkpoint_weight_patches`` (the baseline) for dense and sparse (1 %)
   patches, with the bytes the loader's copies covered ("copied") and the bytes they
   wrote ("written": a NaN-merged copy writes only the patched elements). The target:
   a report costs at most 1.5x the plain load's time, and extra memory no larger than
   the bytes copied;
2. ``density_map`` and ``plot_density`` on a 128256 x 2560 bf16 patch at 1 % density
   (a Llama-3 embedding), next to ``torch.bincount`` over the same indices (the floor).

Usage: ``python benchmarks/bench_inspect.py [--quick] [--device cuda] [--repeats N]``.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import bench_args, fmt_table, median_seconds, peak_extra_bytes
from bench_loader import OneParam, make_patch

import patchkit


def main(argv=None) -> int:
    device, repeats, quick = bench_args(__doc__.splitlines()[0], argv)
    shapes = [(128, 128)] if quick else [(1024, 1024), (4096, 4096)]

    rows = []
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            for density in (None, 0.01):
                model = OneParam(shape, dtype, device)
                patch = make_patch(shape, dtype, density, device)

                def plain(model=model, patch=patch):
                    patchkit.load_checkpoint_weight_patches(model, [patch])

                def report(model=model, patch=patch):
                    return patchkit.inspect_load(model, [patch])

                t_plain = median_seconds(plain, device, repeats)
                t_report = median_seconds(report, device, repeats)
                m_plain = peak_extra_bytes(plain, device)
                m_report = peak_extra_bytes(report, device)
                r = report()
                copied = int(r.writes["elements"].sum()) * dtype.itemsize
                merged = int(r.deltas["elements"].sum()) * dtype.itemsize
                rows.append(
                    [
                        "dense" if density is None else f"sparse {density:.0%}",
                        str(dtype).removeprefix("torch."),
                        f"{shape[0]}x{shape[1]}",
                        f"{t_plain * 1e3:.2f}",
                        f"{t_report * 1e3:.2f}",
                        f"{t_report / t_plain:.2f}x",
                        f"{m_plain / 2**20:.1f}",
                        f"{m_report / 2**20:.1f}",
                        f"{(m_report - m_plain) / 2**20:.1f}",
                        f"{copied / 2**20:.1f}",
                        f"{merged / 2**20:.2f}",
                    ]
                )
                print(".", end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    print(f"inspect_load vs load_checkpoint_weight_patches on {device.type}, median of {repeats}")
    print(
        fmt_table(
            [
                "patch", "dtype", "shape", "plain ms", "report ms", "ratio",
                "plain peak MiB", "report peak MiB", "report extra MiB", "copied MiB",
                "written MiB",
            ],
            rows,
        )
    )

    # -- density map of a big embedding patch ----------------------------------------------
    emb = (128256, 2560) if not quick else (1024, 256)
    patch = make_patch(emb, torch.bfloat16, 0.01, torch.device("cpu"))
    cols = emb[1]

    def floor():
        idx = patch.indices
        torch.bincount((idx // cols * 64 // emb[0]) * 64 + (idx % cols) * 64 // cols)

    def dmap():
        patchkit.density_map(patch, bins=(64, 64))

    import matplotlib

    matplotlib.use("Agg")
    from patchkit import plot

    def pdens():
        plot.plot_density(patch)

    r = [
        ["torch.bincount (floor)", f"{median_seconds(floor, torch.device('cpu'), repeats):.3f}"],
        ["density_map 64x64", f"{median_seconds(dmap, torch.device('cpu'), repeats):.3f}"],
        ["plot_density", f"{median_seconds(pdens, torch.device('cpu'), repeats):.3f}"],
    ]
    nnz = patch.indices.numel()
    print()
    print(f"{emb[0]} x {emb[1]} bf16 patch, {nnz} changes (1 %), CPU, median of {repeats}")
    print(fmt_table(["step", "seconds"], r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
