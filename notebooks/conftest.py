"""nbval runs the tutorials in kernels started from this test run.

Their ``plt.show()`` figures reach the outputs nbval compares through ipykernel's inline
backend. A ``MPLBACKEND`` in the environment (``Agg`` is often set on CI machines) would
replace it in every kernel, and those figures would vanish from the outputs: the kernels
this run starts do without it.
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    os.environ.pop("MPLBACKEND", None)
