"""patchkit ships ``py.typed``: what a user's type checker sees of it is part of the API.

``typing_usage.py`` holds documented usage with the types it must have; mypy checks it
as a user's code (``--strict``; patchkit's own bodies are not checked), and it is run.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USAGE = ROOT / "tests" / "typing_usage.py"


def test_a_type_checker_sees_the_documented_types_of_the_public_api():
    # (the lazily served names were Any, plain 5-tuples were refused, BROKEN_LOADERS'
    # classes had no REASON and an error no report, and a misspelt name passed)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--warn-unused-ignores",
         "--ignore-missing-imports",  # (pandas and ipywidgets ship no types)
         "--follow-imports=silent",  # (what a user sees: patchkit's bodies are not theirs)
         "--cache-dir", str(ROOT / ".mypy_cache"), str(USAGE)],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_typed_usage_runs():
    import matplotlib

    matplotlib.use("Agg")  # (this test only: figures are made and cleared)
    runpy.run_path(str(USAGE), run_name="__main__")
