"""What a new user meets first: the errors, warnings and help texts of everyday mistakes
(from a review that used patchkit as a newcomer would, 2026-12-06)."""

from __future__ import annotations

import sys

import pytest
import torch

import patchkit
from patchkit import CheckpointWeightPatch as CWP
from patchkit.toymodels import PlainModel


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes came in 3.11")
@pytest.mark.parametrize("inspect", [False, True])
def test_a_patch_whose_staging_runs_out_of_memory_is_named_in_the_error(inspect):
    m = PlainModel({"a": (4,), "b": (4,)}, device="cpu")
    good = CWP("a", (4,), torch.float32, torch.tensor([1.0]), torch.tensor([0]))
    # a shape mistyped by orders of magnitude: 1 PiB staged, past any address space
    huge = CWP("b", (2**24, 2**24), torch.float32, torch.tensor([1.0]), torch.tensor([0]))
    load = patchkit.inspect_load if inspect else patchkit.load_checkpoint_weight_patches
    with pytest.raises(RuntimeError) as info:
        load(m, [good, huge], max_chunk_bytes=16)
    (note,) = info.value.__notes__
    assert note == ("(raised staging patch 1 ('b') for load_weights call 1, before that "
                    "call: a sparse patch of shape (16777216, 16777216) torch.float32 "
                    "stages 1 PiB)")
    assert m.a.tolist() == [1.0, 0.0, 0.0, 0.0]  # (call 0 ran; not transactional)
    if inspect:
        assert info.value.report.calls["names"].tolist() == [("a",)]
