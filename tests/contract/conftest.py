"""Fixtures of the contract tests (the loader selection lives in ``tests/conftest.py``)."""

from __future__ import annotations

import pytest

from ._models import PatchMaker


@pytest.fixture(scope="session")
def mk(Patch) -> PatchMaker:
    """Builds dense and sparse patches with the implementation's ``CheckpointWeightPatch``."""
    return PatchMaker(Patch)
