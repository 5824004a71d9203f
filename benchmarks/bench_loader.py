"""Loader speed and memory, side by side with the floor for the same work.

For dense and sparse (0.1 %, 1 %, 10 %) patches of fp32 and bf16 tensors of 1 M, 16 M and
64 M elements, through a plain ``param.data.copy_(w)`` loader, prints:

- patchkit: ``load_checkpoint_weight_patches`` (validation, staging, interception);
- floor: the same values written directly: ``flat.index_copy_(0, idx, values)`` for
  sparse, ``param.copy_(values)`` for dense; what this work costs on this machine;
- ratio = patchkit / floor;
- contract: the work the contract itself asks of a sparse load and nothing more (stage
  a NaN-filled checkpoint tensor, scatter the values, NaN-merge into the parameter), done
  with torch ops, and patchkit / contract: what validation, chunk planning and
  interception add on top, less what patchkit saves on that same work (it stages on huge
  pages and NaN-merges in one compiled pass, so big sparse loads come out below 1);
- vLLM's function of the same name, from the same run, when vLLM is importable;
- validate: the part of the patchkit time spent in validation (CONTRACT §1) alone;
- peak extra memory of the patchkit load (bytes allocated above the starting point),
  next to the peak of validation alone and the staged size (a full checkpoint-shaped
  tensor, also for sparse patches).

Then two tables of what a load costs beyond its bytes: fixed costs on models of many
small tensors (one patch, and a patch for every tensor), and a mixture-of-experts
model's whole checkpoint (mostly expert patches: hundreds to thousands per model), each
next to the same work done with torch ops.

Usage: ``python benchmarks/bench_loader.py [--quick] [--device cuda] [--repeats N] [--threads N]``.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import bench_args, fmt_table, median_seconds, peak_extra_bytes, vllm_loader

import patchkit
from patchkit import CheckpointWeightPatch, dense_patches, random_sparse_patch
from patchkit.patch import validate_patches


class OneParam(torch.nn.Module):
    """One parameter; ``load_weights`` copies the checkpoint tensor into it."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(
            torch.randn(shape, generator=g).to(dtype).to(device), requires_grad=False
        )

    def load_weights(self, weights):
        names = set()
        for name, t in weights:
            self.w.data.copy_(t)
            names.add(name)
        return names


def make_patch(shape, dtype, density, device) -> CheckpointWeightPatch:
    n = 1
    for d in shape:
        n *= d
    g = torch.Generator().manual_seed(1)
    if density is None:
        values = torch.randn(n, generator=g).to(dtype)
        return CheckpointWeightPatch("w", shape, dtype, values.to(device))
    nnz = max(1, round(density * n))
    idx = torch.randperm(n, generator=g)[:nnz].sort().values
    values = torch.randn(nnz, generator=g).to(dtype)
    return CheckpointWeightPatch("w", shape, dtype, values.to(device), idx.to(device))


def contract_fn(model: OneParam, patch: CheckpointWeightPatch):
    """The work the contract itself asks of a sparse load, with nothing else: stage a
    NaN-filled checkpoint tensor, scatter the values, NaN-merge it into the parameter."""
    if patch.indices is None:
        return floor_fn(model, patch)
    idx = patch.indices.long()

    def staged_merge():
        staged = torch.full(patch.shape, float("nan"), dtype=patch.dtype,
                            device=patch.values.device)
        staged.view(-1).index_copy_(0, idx, patch.values)
        w = model.w.data
        w.copy_(torch.where(torch.isnan(staged), w, staged))
    return staged_merge


def floor_fn(model: OneParam, patch: CheckpointWeightPatch):
    if patch.indices is None:
        def dense():
            model.w.data.copy_(patch.values.view(patch.shape))
        return dense
    idx = patch.indices.long()

    def sparse():
        model.w.data.view(-1).index_copy_(0, idx, patch.values)
    return sparse


def main(argv=None) -> int:
    device, repeats, quick = bench_args(__doc__.splitlines()[0], argv)
    sizes = [(64, 64), (256, 256)] if quick else [(1024, 1024), (4096, 4096), (8192, 8192)]
    vllm = vllm_loader()
    rows = []
    for shape in sizes:
        n = shape[0] * shape[1]
        for dtype in (torch.float32, torch.bfloat16):
            for density in (None, 0.001, 0.01, 0.1):
                model = OneParam(shape, dtype, device)
                patch = make_patch(shape, dtype, density, device)

                def ours(model=model, patch=patch):
                    patchkit.load_checkpoint_weight_patches(model, [patch])

                t_ours = median_seconds(ours, device, repeats)

                def check(patch=patch):
                    validate_patches([patch])

                t_check = median_seconds(check, device, repeats)
                t_floor = median_seconds(floor_fn(model, patch), device, repeats)
                t_contract = median_seconds(contract_fn(model, patch), device, repeats)
                t_vllm = None
                if vllm is not None:
                    def theirs(model=model, patch=patch):
                        vllm(model, [patch])
                    t_vllm = median_seconds(theirs, device, repeats)
                peak = peak_extra_bytes(ours, device)
                peak_check = peak_extra_bytes(check, device)
                staged = n * dtype.itemsize
                rows.append(
                    [
                        "dense" if density is None else f"sparse {density:.1%}",
                        str(dtype).removeprefix("torch."),
                        f"{n / 2**20:.0f} Mi" if n >= 2**20 else f"{n / 2**10:.0f} Ki",
                        f"{t_ours * 1e3:.2f}",
                        f"{t_check * 1e3:.2f}",
                        f"{t_floor * 1e3:.2f}",
                        f"{t_ours / t_floor:.1f}x",
                        f"{t_contract * 1e3:.2f}",
                        f"{t_ours / t_contract:.2f}x",
                        "n/a" if t_vllm is None else f"{t_vllm * 1e3:.2f}",
                        f"{peak / 2**20:.1f}",
                        f"{peak_check / 2**20:.1f}",
                        f"{staged / 2**20:.1f}",
                    ]
                )
                print(".", end="", flush=True, file=sys.stderr)
                del model, patch
    print(file=sys.stderr)
    print(
        f"load_checkpoint_weight_patches on {device.type}, median of {repeats}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        fmt_table(
            [
                "patch", "dtype", "elements", "patchkit ms", "validate ms", "floor ms",
                "ratio", "contract ms", "vs contract",
                "vLLM ms", "peak extra MiB", "validate peak MiB", "staged MiB",
            ],
            rows,
        )
    )
    print()
    print(_fixed_costs_table(device, repeats, quick))
    print()
    print(_moe_table(device, repeats, quick))
    return 0


def _staged_by_torch_ops(ps: list[CheckpointWeightPatch], device: torch.device
                         ) -> list[tuple[str, torch.Tensor]]:
    """The floors' staging (CONTRACT §3) with torch ops: a dense patch's values viewed as
    its shape; a sparse one's scattered into a NaN-filled tensor of its shape."""
    staged = []
    for p in ps:
        if p.indices is None:
            staged.append((p.name, p.values.view(p.shape)))
            continue
        t = torch.full(p.shape, float("nan"), dtype=p.dtype, device=device)
        t.view(-1).index_copy_(0, p.indices, p.values)
        staged.append((p.name, t))
    return staged


def _fixed_costs_table(device: torch.device, repeats: int, quick: bool) -> str:
    """What a load costs beyond its bytes, on models of many small (16 x 16 fp32) tensors:
    a load of one patch (an RL loop that sends one tensor per call pays this per tensor)
    and one load of a patch for every tensor, dense and sparse (5 %), next to the
    contract's own work done with torch ops and nothing else (stage, scatter, NaN-merge,
    ``copy_`` into the parameter, found in a dict made once, as a model keeps one): the
    floor. (It built that dict in every timed call: a walk over every parameter, about
    1.2 ms at 1000 tensors, that made a one-patch load look "at the floor".) ``us per
    tensor``: patchkit's time less the floor's, per tensor of the model: for one sparse
    patch, what the index of the model's tensors that a watched load builds costs each
    of them (a dense load of one patch builds none)."""
    from patchkit.toymodels import PlainModel

    counts = (100,) if quick else (100, 1000, 10000)
    rows = []
    for n in counts:
        shapes = {f"layers.{i}.w": (16, 16) for i in range(n)}
        model = PlainModel(shapes, device=device)
        g = torch.Generator().manual_seed(0)
        for kind in ("dense", "sparse 5%"):
            patches = []
            for name, shape in shapes.items():
                if kind == "dense":
                    values = torch.randn(256, generator=g).to(device)
                    patches.append(CheckpointWeightPatch(name, shape, torch.float32, values))
                else:
                    idx = torch.randperm(256, generator=g)[:13].sort().values.to(device)
                    values = torch.randn(13, generator=g).to(device)
                    patches.append(CheckpointWeightPatch(name, shape, torch.float32, values, idx))
            params = dict(model.named_parameters())
            for what, ps in (("one patch", patches[n // 2: n // 2 + 1]),
                             (f"{n} patches, one call", patches)):
                def ours(ps=ps, model=model):
                    patchkit.load_checkpoint_weight_patches(model, ps)

                def bare(ps=ps, params=params):
                    staged = _staged_by_torch_ops(ps, device)
                    with torch.no_grad():
                        for name, t in staged:
                            w = params[name].data
                            w.copy_(t if ps[0].indices is None
                                    else torch.where(torch.isnan(t), w, t))

                t_ours = median_seconds(ours, device, repeats)
                t_bare = median_seconds(bare, device, repeats)
                rows.append([str(n), kind, what, f"{t_ours * 1e3:.2f}", f"{t_bare * 1e3:.2f}",
                             f"{t_ours / t_bare:.1f}x", f"{(t_ours - t_bare) / n * 1e6:.2f}"])
                print(".", end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    return (
        "fixed costs: models of n tensors of 16 x 16 fp32 (PlainModel), median of "
        f"{repeats}; floor: the contract's work with torch ops only (stage, scatter, "
        "NaN-merge, copy_)\n"
        + fmt_table(["tensors", "patches", "load", "patchkit ms", "floor ms", "ratio",
                     "us per tensor"], rows)
    )


def _moe_table(device: torch.device, repeats: int, quick: bool) -> str:
    """A mixture-of-experts model's whole checkpoint, one patch per tensor (three per
    expert per layer: the patch count of an MoE model is mostly experts), dense and
    sparse (2 % of each tensor), into rank 0 of 2 of a bf16 ``TinyLlamaRuntime`` with
    ``num_experts``, next to the floor: the same patches staged with torch ops (values
    viewed as the shape; for sparse, a NaN-filled tensor with the values scattered in)
    and handed to the model's own ``load_weights`` in one call, with no interception
    (so the sparse floor writes the NaN it cannot merge: the work without the merge,
    which is a small part). ``per patch us``: patchkit's time less the floor's, per
    patch: what the contract's checks and the sparse call's interception add to each."""
    from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

    shapes = [(8, 1)] if quick else [(8, 2), (64, 4), (128, 4)]
    rows = []
    g = torch.Generator().manual_seed(0)
    for experts, layers in shapes:
        config = TinyLlamaConfig(num_experts=experts, num_layers=layers, intermediate_size=64)
        ckpt = tiny_llama_checkpoint(config, seed=0, dtype=torch.bfloat16)
        model = TinyLlamaRuntime(config, tp_rank=0, tp_size=2, device=device)
        for kind in ("dense", "sparse 2%"):
            patches = (
                dense_patches({name: t.to(device) for name, t in ckpt.items()})
                if kind == "dense" else
                [random_sparse_patch(name, t.shape, t.dtype, 0.02, generator=g, device=device)
                 for name, t in ckpt.items()]
            )

            def ours(ps=patches, model=model):
                patchkit.load_checkpoint_weight_patches(model, ps)

            def bare(ps=patches, model=model):
                staged = _staged_by_torch_ops(ps, device)
                with torch.no_grad():
                    model.load_weights(staged)

            t_ours = median_seconds(ours, device, repeats)
            t_bare = median_seconds(bare, device, repeats)
            n = len(patches)
            rows.append([str(experts), str(layers), str(n), kind, f"{t_ours * 1e3:.1f}",
                         f"{t_bare * 1e3:.1f}", f"{t_ours / t_bare:.1f}x",
                         f"{(t_ours - t_bare) / n * 1e6:.0f}"])
            print(".", end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    return (
        "mixture of experts: a whole checkpoint, one patch per tensor, into rank 0 of 2 of a "
        f"bf16 TinyLlamaRuntime with num_experts (intermediate 64), median of {repeats}; "
        "floor: staged with torch ops and sent to load_weights in one call, unwatched\n"
        + fmt_table(["experts", "layers", "patches", "patches are", "patchkit ms", "floor ms",
                     "ratio", "per patch us"], rows)
    )


if __name__ == "__main__":
    sys.exit(main())
