"""What a user's type checker sees of patchkit, which ships ``py.typed``.

``tests/test_typing.py`` runs mypy (``--strict``, ``--warn-unused-ignores``) on this file,
and runs the file, so each line holds both for the checker and at run time: documented
usage type-checks, and the types asserted are the ones a call returns. A line that ends
in ``# type: ignore[code]`` must be an error of that code (an unneeded one is reported).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from matplotlib.figure import Figure
from typing_extensions import assert_type

import patchkit
from patchkit import CheckpointWeightPatch, LoadReport, plan_chunks
from patchkit.patch import PatchLike
from patchkit.toymodels import BROKEN_LOADERS, PlainModel


def main() -> None:
    model = PlainModel({"w": (4, 4)})
    dense = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(16))
    assert_type(dense.values, torch.Tensor)
    assert_type(dense.indices, torch.Tensor | None)

    # The names served lazily at run time (pandas, matplotlib and ipywidgets load on
    # first use) have their types for a checker.
    report = patchkit.inspect_load(model, [dense])
    assert_type(report, LoadReport)
    assert_type(patchkit.patch_summary([dense]), pd.DataFrame)
    assert_type(patchkit.plot.plot_chunks(report), Figure)
    assert_type(patchkit.native.status(), str)
    assert_type(report.summary(), dict[str, Any])
    Figure.clear(report.plot_chunks())

    # A plain 5-tuple is taken wherever a patch is, as a load takes it.
    sparse = ("w", (4, 4), torch.float32, torch.tensor([2.0]), torch.tensor([5]))
    patches: list[PatchLike] = [dense, sparse]
    patchkit.load_checkpoint_weight_patches(model, [sparse], max_chunk_bytes=1 << 20)
    patchkit.inspect_load(model, [sparse])
    assert_type(plan_chunks(patches), list[patchkit.Chunk])
    assert_type(patchkit.wire_bytes(sparse), int)
    assert_type(patchkit.density_map(sparse, bins=(2, 2)), torch.Tensor)
    assert_type(patchkit.stage(sparse), torch.Tensor)
    assert_type(patchkit.split_patch(sparse, 2), list[CheckpointWeightPatch])
    patchkit.patch_summary([sparse])
    Figure.clear(patchkit.plot.plot_density(sparse))
    with tempfile.TemporaryDirectory() as folder:
        patchkit.save_patches(Path(folder) / "p.safetensors", [sparse])

    # The broken loaders of notebook 05: each class says what it breaks.
    for cls in BROKEN_LOADERS.values():
        assert_type(cls.REASON, str)
        broken = cls({"w": (4, 4)}, fill=1.0)
        broken.load_weights([("w", torch.zeros(4, 4))])

    # A failed inspected load's error carries its report.
    try:
        patchkit.inspect_load(model, [("w", (4, 4), torch.float32, torch.ones(1),
                                       torch.tensor([99]))])
    except patchkit.PatchError as e:
        assert_type(e.report, LoadReport)
        assert e.report.patches[0].name == "w"
    else:
        raise AssertionError("an index out of range was loaded")


def never_called() -> None:
    """What a checker must refuse (each is an error at run time too)."""
    patchkit.inspect_laod  # type: ignore[attr-defined]  # noqa: B018
    PlainModel({"w": (4,)}, device=3.5)  # type: ignore[arg-type]
    patchkit.load_checkpoint_weight_patches(PlainModel({"w": (4,)}), [("w", (4,))])  # type: ignore[list-item]


if __name__ == "__main__":
    main()
