"""What only a CUDA device can show: patches and models on different devices, the one host
wait per device in validation, and reports that agree with the CPU's.

These run where ``torch.cuda.is_available()`` (``scripts/gpu-check`` runs them, and the
whole suite with ``--device cuda``); on a machine without a GPU they are skipped, since
there is no device to put anything on.
"""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

import patchkit
from patchkit import CheckpointWeightPatch, load_checkpoint_weight_patches, random_sparse_patch
from patchkit.patch import validate_patches
from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIG = TinyLlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=8, num_kv_heads=4)


def _sparse_patches(seed: int, *, values_device: str, index_device: str,
                    index_dtype=torch.int32) -> list[CheckpointWeightPatch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in tiny_llama_checkpoint(CONFIG, dtype=torch.bfloat16).items():
        p = random_sparse_patch(name, t.shape, torch.bfloat16, 0.05, generator=g,
                                index_dtype=index_dtype)
        out.append(CheckpointWeightPatch(p.name, p.shape, p.dtype, p.values.to(values_device),
                                         p.indices.to(index_device)))
    return out


def _ranks(device: str, tp_size: int = 2) -> list[TinyLlamaRuntime]:
    ckpt = tiny_llama_checkpoint(CONFIG, dtype=torch.bfloat16)
    ranks = [TinyLlamaRuntime(CONFIG, r, tp_size, dtype=torch.bfloat16, device=device)
             for r in range(tp_size)]
    for rt in ranks:
        rt.load_weights(ckpt.items())
    return ranks


def _cpu_state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in m.state_dict().items()}


@pytest.mark.parametrize(("values_device", "index_device"),
                         [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cpu")])
def test_sparse_load_into_a_cuda_model_matches_the_cpu_load_bit_for_bit(
        values_device, index_device):
    want = _ranks("cpu")
    got = _ranks("cuda")
    for rt in want:
        load_checkpoint_weight_patches(rt, _sparse_patches(1, values_device="cpu",
                                                           index_device="cpu"))
    for rt in got:
        load_checkpoint_weight_patches(
            rt, _sparse_patches(1, values_device=values_device, index_device=index_device),
            max_chunk_bytes=64 << 10)
    for a, b in zip(want, got):
        assert patchkit.same_state(_cpu_state(a), _cpu_state(b))
        assert all(p.device.type == "cuda" for p in b.parameters())


def test_dense_cpu_patches_land_on_the_cuda_model():
    ckpt = tiny_llama_checkpoint(CONFIG, seed=3, dtype=torch.bfloat16)
    want, got = _ranks("cpu"), _ranks("cuda")
    patches = patchkit.dense_patches(ckpt)
    for rt in want:
        load_checkpoint_weight_patches(rt, patches)
    for rt in got:
        load_checkpoint_weight_patches(rt, patches)
    for a, b in zip(want, got):
        assert patchkit.same_state(_cpu_state(a), _cpu_state(b))


def test_validation_waits_for_the_device_once_for_many_patches():
    patches = _sparse_patches(2, values_device="cuda", index_device="cuda")
    assert len(patches) > 4
    assert _syncs(lambda: validate_patches(patches)) == 1


def test_validation_sync_is_the_flag_read():
    """Where each wait happens (the line in patchkit that asked for it)."""
    patches = _sparse_patches(2, values_device="cuda", index_device="cuda")
    where: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            ours = [f for f in traceback.extract_stack()[:-1] if "patchkit" in f.filename
                    and "tests" not in f.filename]
            where.append(f"{ours[-1].name}:{ours[-1].line}" if ours else "outside patchkit")

    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            validate_patches(patches)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert len(where) == 1 and "flags.cpu()" in where[0], where


def test_bad_index_found_on_the_device_names_the_patch():
    patches = _sparse_patches(4, values_device="cuda", index_device="cuda")
    bad = patches[3]
    idx = bad.indices.clone()
    idx[1] = idx[0]
    patches[3] = CheckpointWeightPatch(bad.name, bad.shape, bad.dtype, bad.values, idx)
    with pytest.raises(ValueError, match="duplicate") as info:
        validate_patches(patches)
    assert info.value.position == 3 and info.value.name == bad.name


@pytest.mark.parametrize(("devices", "first"), [(("cpu", "cuda", "cpu"), 0),
                                               (("cpu", "cuda", "cpu"), 1)])
def test_bad_patches_on_two_devices_name_the_first_by_position(devices, first):
    # (each device's flags are read in turn, the CPU's first here: the patch named is the
    # first bad one by position, whichever device found it)
    def patch(k, device, bad):
        idx = torch.tensor([1, 1] if bad else [1, 2], device=device)  # (bad: a repeat)
        return CheckpointWeightPatch(f"w{k}", (8,), torch.float32,
                                     torch.ones(2, device=device), idx)

    patches = [patch(k, d, bad=k >= first) for k, d in enumerate(devices)]
    with pytest.raises(ValueError, match="duplicate") as info:
        validate_patches(patches)
    assert (info.value.position, info.value.name) == (first, f"w{first}")


def test_a_foreach_copy_into_a_cpu_and_a_cuda_parameter_counts_each_change():
    # (one op writing targets on two devices: each target's changed elements are counted
    # on its own device)
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
            self.b = torch.nn.Parameter(torch.zeros(4, device="cuda"), requires_grad=False)

        def load_weights(self, weights):
            ws = dict(weights)
            torch._foreach_copy_([self.a, self.b], [ws["a"], ws["b"].to("cuda")])
            return set(ws)

    m = Mixed()
    r = patchkit.inspect_load(m, [
        CheckpointWeightPatch("a", (4,), torch.float32, torch.ones(4)),
        CheckpointWeightPatch("b", (4,), torch.float32, torch.arange(4.0))])
    assert r.error is None
    assert (r.deltas.loc["a", "changed"], r.deltas.loc["b", "changed"]) == (4, 3)
    assert m.a.eq(1).all() and m.b.cpu().equal(torch.arange(4.0))


def test_report_on_cuda_matches_the_report_on_cpu():
    from patchkit import inspect_load

    reports = []
    for device in ("cpu", "cuda"):
        rt = _ranks(device)[1]
        reports.append(inspect_load(rt, _sparse_patches(5, values_device=device,
                                                        index_device=device),
                                    max_chunk_bytes=32 << 10))
    cpu, cuda = reports
    cols = ["chunk", "name", "checkpoint_offset", "target", "target_offset", "elements",
            "changed"]
    assert cpu.writes[cols].equals(cuda.writes[cols])
    assert cpu.deltas[["elements", "changed"]].equals(cuda.deltas[["elements", "changed"]])
    assert cpu.chunks.equals(cuda.chunks)
    for target in cpu.deltas.index:
        assert patchkit.same_bits(cpu.after(target), cuda.after(target).cpu())
        assert patchkit.same_bits(cpu.before(target), cuda.before(target).cpu())


@pytest.mark.parametrize("patch_device", ["cpu", "cuda"])
def test_dense_report_on_cuda_matches_the_report_on_cpu(patch_device):
    # the compared copies of a dense report take torch ops on a GPU (no compiled path)
    from patchkit import inspect_load

    step = tiny_llama_checkpoint(CONFIG, seed=7, dtype=torch.bfloat16)
    reports = []
    for device in ("cpu", "cuda"):
        on = device if patch_device == "cuda" else "cpu"
        patches = [CheckpointWeightPatch(p.name, p.shape, p.dtype, p.values.to(on))
                   for p in patchkit.dense_patches(step)]
        reports.append(inspect_load(_ranks(device)[0], patches, max_chunk_bytes=32 << 10))
    cpu, cuda = reports
    cols = ["chunk", "name", "checkpoint_offset", "target", "target_offset", "elements",
            "changed"]
    assert cpu.writes[cols].equals(cuda.writes[cols])
    assert cpu.deltas[["elements", "changed"]].equals(cuda.deltas[["elements", "changed"]])
    for col in ("max_abs", "mean_abs", "rel_l2"):  # (sums in another order)
        assert cpu.deltas[col].to_numpy() == pytest.approx(cuda.deltas[col].to_numpy(),
                                                           rel=1e-6)
    assert (cuda.calls["seconds"] >= 0).all()
    for target in cpu.deltas.index:
        assert patchkit.same_bits(cpu.after(target), cuda.after(target).cpu())
        assert patchkit.same_bits(cpu.before(target), cuda.before(target).cpu())


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_failed_transactional_load_on_cuda_is_rolled_back_bit_for_bit(sparse):
    rt = _ranks("cuda")[0]
    before = _cpu_state(rt)
    if sparse:
        patches = _sparse_patches(6, values_device="cuda", index_device="cuda")
    else:
        patches = patchkit.dense_patches(tiny_llama_checkpoint(CONFIG, seed=8,
                                                               dtype=torch.bfloat16))
    # an unknown name in the last call: the loader raises KeyError after the others wrote
    one = torch.ones(1, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(1, dtype=torch.int64, device="cuda") if sparse else None
    extra = CheckpointWeightPatch("no.such.weight", (2,) if sparse else (1,), torch.bfloat16,
                                  one, idx)
    patches = [*patches, extra]
    with pytest.raises(KeyError):
        load_checkpoint_weight_patches(rt, patches, transactional=True,
                                       max_chunk_bytes=16 << 10)
    assert patchkit.same_state(before, _cpu_state(rt))


def _syncs(fn) -> int:
    """How many times ``fn`` made the host wait for the GPU (torch's sync debug mode)."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_report_on_cuda_waits_a_fixed_number_of_times_per_write(sparse):
    # it waited once or more per 256 K-element block of every write, four times per write
    # of these small tensors
    from patchkit import inspect_load

    if sparse:
        patches = _sparse_patches(9, values_device="cuda", index_device="cuda")
    else:
        step = tiny_llama_checkpoint(CONFIG, seed=9, dtype=torch.bfloat16)
        patches = [CheckpointWeightPatch(p.name, p.shape, p.dtype, p.values.cuda())
                   for p in patchkit.dense_patches(step)]
    fresh = _ranks("cuda")[0], _ranks("cuda")[0]  # (each load changes what it writes)
    plain = _syncs(lambda: load_checkpoint_weight_patches(fresh[0], patches))
    box = []
    report = _syncs(lambda: box.append(inspect_load(fresh[1], patches)))
    writes, calls = len(box[0].writes), len(box[0].calls)
    # dense: one read per write (its count of changes); sparse: two (where it writes, what
    # it changed); one at the end for every tensor's numbers; and a recorded call waits
    # for the GPU before and after, so that its seconds are the call's own
    bound = (2 if sparse else 1) * writes + 1 + 2 * calls
    assert report - plain <= bound, (report, plain, writes, calls)
