"""One wording per problem: errors that mean the same thing in different modules carry
the same ``reason`` (and messages the same phrase), so a caller matching reasons, or a
user grepping a log, finds every case by one word. Each test here failed before its fix."""

from __future__ import annotations

import pytest
import torch

import patchkit
from patchkit import CheckpointWeightPatch as CWP
from patchkit import density_map
from patchkit.build import changed_fraction, sparse_patches_from_diff
from patchkit.errors import PatchValueError
from patchkit.io import load_patches, read_patch_index, save_patches
from patchkit.toymodels import PlainModel


def test_a_number_outside_what_it_may_be_is_out_of_range_for_indices_and_integer_values():
    # (an integer value outside its dtype was reason "out of range", an index outside its
    # tensor "out-of-range")
    m = PlainModel({"w": (4,)})
    with pytest.raises(PatchValueError) as index:
        patchkit.load_checkpoint_weight_patches(
            m, [CWP("w", (4,), torch.float32, torch.ones(1), torch.tensor([9]))])
    m = PlainModel({"i": (2,)}, dtype=torch.uint8)
    with pytest.raises(PatchValueError) as value:
        patchkit.load_checkpoint_weight_patches(
            m, [CWP("i", (2,), torch.uint8, torch.tensor([7, 300]))])
    assert (index.value.reason, index.value.value) == ("out-of-range", 9)
    assert (value.value.reason, value.value.value) == ("out-of-range", 300)
    assert str(value.value).startswith("patch 0 ('i'): value 300 at values[1] ")


def test_a_tensor_on_the_meta_device_is_reason_meta_device_and_said_so_everywhere(tmp_path):
    # (the builders said "meta tensor", density_map "meta indices", a device argument
    # "meta tensors hold no data"; the loader and patch files "meta device")
    meta = torch.empty(4, device="meta")
    sparse = CWP("w", (4,), torch.float32, torch.ones(2, device="meta"),
                 torch.tensor([0, 1], device="meta"))
    dense = CWP("w", (4,), torch.float32, torch.ones(4, device="meta"))
    raisers = [
        lambda: sparse_patches_from_diff({"w": meta}, {"w": meta}),
        lambda: changed_fraction({"w": meta}, {"w": meta}),
        lambda: density_map(sparse),
        lambda: load_patches(str(tmp_path / "x.safetensors"), device="meta"),
        lambda: save_patches(str(tmp_path / "y.safetensors"), [dense]),
        lambda: patchkit.load_checkpoint_weight_patches(PlainModel({"w": (4,)}), [dense]),
    ]
    for raise_it in raisers:
        with pytest.raises(PatchValueError) as info:
            raise_it()
        assert info.value.reason == "meta device", str(info.value)
        assert "the meta device" in str(info.value)


@pytest.mark.parametrize("fn", [sparse_patches_from_diff, changed_fraction])
def test_both_diff_builders_refuse_a_changed_shape_or_dtype_in_the_same_words(fn):
    # (changed_fraction said "'w': before is (2, 3) torch.float32, after is ...", reason
    # "shape or dtype differs", where sparse_patches_from_diff says which of the two)
    with pytest.raises(PatchValueError) as info:
        fn({"w": torch.zeros(2, 3)}, {"w": torch.zeros(3, 2)})
    e = info.value
    assert str(e) == "weight 'w' changed shape: before (2, 3), after (3, 2)"
    assert (e.name, e.reason, e.value) == ("w", "shape differs", ((2, 3), (3, 2)))
    with pytest.raises(PatchValueError) as info:
        fn({"w": torch.zeros(4)}, {"w": torch.zeros(4, dtype=torch.float64)})
    e = info.value
    assert str(e) == "weight 'w' changed dtype: before torch.float32, after torch.float64"
    assert (e.name, e.reason, e.value) == ("w", "dtype differs", (torch.float32, torch.float64))


@pytest.mark.parametrize("read", [load_patches, read_patch_index])
def test_reading_a_path_holding_a_nul_says_what_saving_to_it_says(tmp_path, read):
    # (a reader said "cannot be opened: embedded null byte", os's words, reason
    # "unreadable"; save_patches "the path holds a NUL character", reason "bad path")
    path = str(tmp_path / "a\0b.safetensors")
    with pytest.raises(PatchValueError) as saved:
        save_patches(path, [CWP("w", (1,), torch.float32, torch.ones(1))])
    with pytest.raises(PatchValueError) as info:
        read(path)
    e = info.value
    assert str(e) == f"patch file {path!r}: the path holds a NUL character, which no " \
        "file's path can hold"
    assert str(saved.value).endswith(str(e).split(": ", 1)[1])
    assert (e.reason, e.value) == (saved.value.reason, path) == ("bad path", path)
