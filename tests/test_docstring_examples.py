"""The examples in patchkit's docstrings (``>>>`` lines) run, and print what they say.

A reader copies these into a session; one that raises or prints something else teaches the
wrong thing, so each module's examples run here as doctests.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import patchkit

MODULES = sorted(
    f"patchkit.{m.name}" for m in pkgutil.iter_modules(patchkit.__path__) if m.name != "__main__"
)


def _examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    # A module's own objects only: a name it imports from another module is that one's.
    return [t for t in doctest.DocTestFinder().find(module, name) if t.examples]


def test_modules_found() -> None:
    assert "patchkit.loader" in MODULES and "patchkit.inspect" in MODULES


def test_some_docstrings_have_examples() -> None:
    with_examples = [name for name in MODULES if _examples(name)]
    # The three that carry examples today; a module may gain some, none may lose them
    # unnoticed (this test is what runs them).
    assert {"patchkit.patch", "patchkit.density", "patchkit.chunking"} <= set(with_examples)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failures: list[str] = []
    for test in _examples(name):
        out: list[str] = []
        result = runner.run(test, out=out.append)
        if result.failed:
            failures.append("".join(out))
    assert not failures, "\n".join(failures)


def test_a_wrong_example_fails() -> None:
    # The runner above reports a failing example (so a green run means the examples ran).
    parser = doctest.DocTestParser()
    test = parser.get_doctest(">>> 1 + 1\n3\n", {}, "wrong", None, 0)
    result = doctest.DocTestRunner().run(test, out=lambda s: None)
    assert (result.failed, result.attempted) == (1, 1)
