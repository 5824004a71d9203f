"""Building sparse patches from a trainer step: ``sparse_patches_from_diff`` against a
one-shot diff of the same pair.

For a 128256 x 2560 bf16 embedding (626 MiB) with 1 % of its elements changed, as
stored (contiguous) and as a transposed view (a trainer's ``weight.t()``, a tied or
column-major weight), prints time and peak extra memory of:

- patchkit: ``sparse_patches_from_diff`` (the diff taken in pieces of about 4 M elements:
  only one piece's mask and positions are held at a time);
- one-shot: the same diff done in one go with torch ops, as patchkit did before the
  pieces: a bool mask of the whole tensor, its nonzero positions, then the values
  gathered from a contiguous copy of ``after``. The floor of time, not of memory;
- the patch's own size (values and int32 indices): what any way of making it must hold.

Usage: ``python benchmarks/bench_build.py [--quick] [--device cuda] [--repeats N] [--threads N]``.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import bench_args, fmt_table, interleaved_medians, peak_extra_bytes

from patchkit.bitwise import bits
from patchkit.build import sparse_patches_from_diff


def pair(shape: tuple[int, int], density: float, device: torch.device):
    """A bf16 weight and a copy with ``density`` of its elements changed (made on the
    CPU from fixed seeds, then moved)."""
    g = torch.Generator().manual_seed(0)
    before = torch.randn(shape, generator=g, dtype=torch.bfloat16)
    after = before.clone()
    n = before.numel()
    k = round(density * n)
    flat = after.view(-1)
    pos = torch.randint(0, n, (k,), generator=g)
    flat[pos] = flat[pos] + torch.tensor(0.5, dtype=torch.bfloat16)
    return before.to(device), after.to(device)


def one_shot(before: torch.Tensor, after: torch.Tensor):
    """The whole diff at once (the way patchkit took it before it went in pieces)."""
    mask = (bits(before) != bits(after)).reshape(-1)
    idx = torch.nonzero(mask).reshape(-1)
    values = after.contiguous().reshape(-1).index_select(0, idx)
    return values, idx.to(torch.int32)


def main(argv=None) -> int:
    device, repeats, quick = bench_args(__doc__.splitlines()[0], argv)
    shape = (1024, 256) if quick else (128256, 2560)
    before, after = pair(shape, 0.01, device)
    rows = []
    for layout, (b, a) in (("contiguous", (before, after)),
                           ("transposed", (before.t(), after.t()))):
        def ours(b=b, a=a):
            return sparse_patches_from_diff({"w": b}, {"w": a})

        def theirs(b=b, a=a):
            return one_shot(b, a)

        (p,) = ours()
        values, idx = theirs()
        # the same patch both ways, or the comparison means nothing
        assert torch.equal(p.indices, idx) and torch.equal(bits(p.values), bits(values))
        t_ours, t_theirs = interleaved_medians([ours, theirs], device, repeats)
        m_ours, m_theirs = (peak_extra_bytes(f, device) / 2**20 for f in (ours, theirs))
        patch_mib = (p.values.nbytes + p.indices.nbytes) / 2**20
        rows.append([layout, f"{t_ours * 1e3:.1f}", f"{t_theirs * 1e3:.1f}",
                     f"{t_ours / t_theirs:.2f}x", f"{m_ours:.1f}", f"{m_theirs:.1f}",
                     f"{patch_mib:.1f}"])
        print(".", end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    n = shape[0] * shape[1]
    print(f"sparse_patches_from_diff vs a one-shot diff: {shape[0]} x {shape[1]} bf16 "
          f"({n * 2 / 2**20:.0f} MiB per tensor), 1 % changed, on {device.type}, "
          f"median of {repeats}, {torch.get_num_threads()} threads")
    print(fmt_table(["after", "patchkit ms", "one-shot ms", "ratio", "patchkit peak MiB",
                     "one-shot peak MiB", "patch MiB"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
