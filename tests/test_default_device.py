"""patchkit places the tensors it makes itself, whatever torch's default device is.

A notebook that ran ``torch.set_default_device("cuda")`` must get the same builders,
reports and figures as one that did not. Here the default device is ``meta`` (which every
CPU machine has): any tensor the library made without naming a device would land there
and fail the first time it met a CPU tensor.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import patchkit
from patchkit import density_map, inspect_load, random_sparse_patch
from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

CONFIG = TinyLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2)


@pytest.fixture
def meta_default():
    with torch.device("meta"):
        assert torch.empty(1).device.type == "meta"
        yield


def test_builders_and_density_maps_stay_on_the_cpu(meta_default):
    g = torch.Generator().manual_seed(0)
    for pattern in ("uniform", "rows", "blocks"):
        p = random_sparse_patch("w", (64, 32), torch.bfloat16, 0.1, pattern=pattern, generator=g)
        assert p.values.device.type == p.indices.device.type == "cpu"
        dm = density_map(p, (8, 8))
        assert dm.device.type == "cpu"
        assert abs(float(dm.mean()) - p.values.numel() / (64 * 32)) < 1e-6
    ckpt = tiny_llama_checkpoint(CONFIG)
    assert all(t.device.type == "cpu" for t in ckpt.values())


def test_a_report_and_its_figures_on_a_cpu_model(meta_default):
    from patchkit.plot import plot_delta, plot_density, plot_placement

    ckpt = tiny_llama_checkpoint(CONFIG)
    rt = TinyLlamaRuntime(CONFIG, 1, 2, device="cpu")
    rt.load_weights(ckpt.items())
    g = torch.Generator().manual_seed(1)
    patches = [random_sparse_patch(n, t.shape, t.dtype, 0.05, generator=g)
               for n, t in ckpt.items()]
    report = inspect_load(rt, patches, max_chunk_bytes=4096)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    written = report.written(qkv)
    assert written.device.type == "cpu" and int(written.sum()) > 0
    assert int(report.deltas.loc[qkv, "changed"]) == int(
        (patchkit.bitwise.bits(report.before(qkv)) != patchkit.bitwise.bits(report.after(qkv)))
        .sum())
    for fig in (plot_density(patches[1]), plot_placement(report), plot_delta(report, qkv)):
        assert fig.axes


def test_the_tour_checks_hold(meta_default, tmp_path):
    from patchkit.tour import run_tour

    result = run_tour(tmp_path / "tour", echo=lambda _: None)
    assert result.ok, result.checks  # (a TourResult is true whatever its checks say)


def test_big_sparse_staging_and_its_duplicate_check_stay_on_the_cpu(meta_default):
    # Big enough (8 MiB staged, 2 M marks) for the buffers that ask for huge pages.
    from patchkit.patch import validate_patches
    from patchkit.staging import stage

    n = 1 << 21
    idx = torch.arange(0, n, 4, dtype=torch.int64, device="cpu")  # dense enough to mark
    vals = torch.arange(idx.numel(), dtype=torch.float32, device="cpu")
    p = patchkit.CheckpointWeightPatch("w", (n // 1024, 1024), torch.float32, vals, idx)
    validate_patches([p])
    staged = stage(p)
    assert staged.device.type == "cpu" and staged.shape == (n // 1024, 1024)
    flat = staged.view(-1)
    assert torch.equal(flat[idx], vals)
    assert int(torch.isnan(flat).sum()) == n - idx.numel()
    dup = patchkit.CheckpointWeightPatch(
        "w", (n // 1024, 1024), torch.float32, vals,
        torch.cat([idx[:-1], idx[:1]]))  # the last index repeats the first
    with pytest.raises(ValueError, match="duplicate"):
        validate_patches([dup])


def test_the_nan_check_of_a_sparse_patchs_dtype_stays_on_the_cpu(monkeypatch):
    # (the check that a sparse patch's dtype holds NaN made its NaN on the default device:
    # under a meta default, the first sparse patch of a dtype was refused as "cannot be
    # staged (Tensor.item() cannot be called on meta tensors)", and, that verdict being
    # remembered, so was every later one of that dtype, outside the meta default too)
    import patchkit.patch
    from patchkit.patch import validate_patches

    monkeypatch.setattr(patchkit.patch, "_STAGEABLE", {})  # (as in a fresh process)
    p = patchkit.CheckpointWeightPatch(
        "w", (4,), torch.bfloat16, torch.ones(1, dtype=torch.bfloat16, device="cpu"),
        torch.tensor([0], device="cpu"))
    with torch.device("meta"):
        validate_patches([p])
    validate_patches([p])
    assert patchkit.patch._STAGEABLE[(torch.bfloat16, torch.bfloat16, True)] is True


def test_the_flags_of_short_sparse_patches_stay_on_the_cpu():
    # (a short CPU index list is checked as Python ints, and its row of flags is one of a
    # few made once: made on the default device, the first one made under a meta default
    # would be a meta tensor, which the CPU rows it is stacked with, and every later
    # validation that reused it, could not take)
    import patchkit.patch
    from patchkit.patch import validate_patches

    def sparse(values, indices):
        return patchkit.CheckpointWeightPatch(
            "w", (4,), torch.float32, torch.tensor(values, device="cpu"),
            torch.tensor(indices, device="cpu"))

    cases = [(sparse([1.0, 2.0], [0, 1]), None),
             (sparse([1.0, 2.0], [1, 1]), "duplicate"),
             (sparse([1.0, 2.0], [1, 4]), "out-of-range"),
             (sparse([1.0, float("nan")], [1, 2]), "NaN")]
    patchkit.patch._flag_row.cache_clear()  # (as in a fresh process)
    try:
        for meta in (True, False):
            for p, reason in cases:
                with torch.device("meta") if meta else contextlib.nullcontext():
                    if reason is None:
                        assert validate_patches([p, p._replace(name="v")]) == "sparse"
                        continue
                    with pytest.raises(ValueError) as e:
                        validate_patches([p._replace(name="v", indices=torch.tensor(
                            [0, 1], device="cpu"), values=torch.ones(2, device="cpu")), p])
                    assert (e.value.position, e.value.reason) == (1, reason)
    finally:
        patchkit.patch._flag_row.cache_clear()
