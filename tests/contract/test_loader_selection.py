"""The suite can be pointed at another implementation (``tests/conftest.py``).

``--loader=module:function`` wins over ``PATCHKIT_LOADER``; the default is patchkit's.
``Patch`` is the selected module's ``CheckpointWeightPatch`` when it has one, else
patchkit's. ``patchkit_only`` tests are skipped when another loader is selected.
Each check runs a small pytest session (in-process, via ``pytester``) with this suite's
conftest and a wrapper module that forwards to patchkit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import patchkit

HERE = Path(__file__).parent
CONFTEST = (HERE.parent / "conftest.py").read_text()
ALT_LOADER = (HERE / "_alt_loader.py").read_text()

PROBE = '''
import pytest

def test_reports(load, Patch, patchkit_selected):
    print(f"LOADER={load.__module__}:{load.__name__} "
          f"PATCH={Patch.__module__}.{Patch.__name__} PATCHKIT={patchkit_selected}")

@pytest.mark.patchkit_only
def test_patchkit_only():
    pass
'''

BARE_LOADER = '''
import patchkit

def load(model, patches, **kwargs):
    return patchkit.load_checkpoint_weight_patches(model, patches, **kwargs)
'''

ALT = "_alt_loader:load_checkpoint_weight_patches"


@pytest.fixture
def session(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PATCHKIT_LOADER", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(_alt_loader=ALT_LOADER, _bare_loader=BARE_LOADER, test_probe=PROBE)
    pytester.syspathinsert()

    def run(*args: str, env: str | None = None) -> pytest.RunResult:
        if env is not None:
            monkeypatch.setenv("PATCHKIT_LOADER", env)
        return pytester.runpytest(
            "-s", "-rs", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", *args
        )

    return run


def test_default_loader_is_patchkit_and_runs_patchkit_only_tests(session):
    result = session()
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "*LOADER=patchkit.loader:load_checkpoint_weight_patches "
        "PATCH=patchkit.patch.CheckpointWeightPatch PATCHKIT=True*",
    ])


def test_loader_option_selects_another_loader_and_skips_patchkit_only(session):
    result = session(f"--loader={ALT}")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "*LOADER=_alt_loader:load_checkpoint_weight_patches*PATCHKIT=False*",
        "*patchkit-only behaviour; the loader under test is _alt_loader*",
    ])


def test_environment_variable_selects_the_loader(session):
    result = session(env=ALT)
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*LOADER=_alt_loader:load_checkpoint_weight_patches*"])


def test_option_wins_over_environment_variable(session):
    result = session("--loader=patchkit:load_checkpoint_weight_patches", env=ALT)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*LOADER=patchkit.loader:*PATCHKIT=True*"])


def test_patch_falls_back_to_patchkit_when_the_module_has_none(session):
    result = session("--loader=_bare_loader:load")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "*LOADER=_bare_loader:load PATCH=patchkit.patch.CheckpointWeightPatch PATCHKIT=False*"
    ])


@pytest.mark.parametrize(
    "spec", ["no_colon_here", "_alt_loader:missing", "no_such_module_xyz:load", ":load"]
)
def test_bad_loader_spec_is_a_usage_error(session, spec):
    result = session(f"--loader={spec}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--loader/PATCHKIT_LOADER*"])


@pytest.mark.parametrize(("source", "shown"), [
    ("from torch import no_such_name_xyz\n", "importing _broken failed: ImportError: cannot"),
    ("import no_such_dependency_xyz\n",
     "importing _broken failed: ModuleNotFoundError: No module named 'no_such_dependency_xyz'"),
    ("raise RuntimeError('set-up failed')\n",
     "importing _broken failed: RuntimeError: set-up failed"),
    ("def load(:\n", "importing _broken failed: SyntaxError:"),
])
def test_a_loader_module_that_fails_to_import_is_a_usage_error(session, pytester, source, shown):
    pytester.makepyfile(_broken=source)
    result = session("--loader=_broken:load")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--loader/PATCHKIT_LOADER '_broken:load': {shown}*"])
    assert "INTERNALERROR" not in result.stderr.str() + result.stdout.str()


def test_alt_loader_forwards_to_patchkit():
    from . import _alt_loader

    assert _alt_loader.CheckpointWeightPatch is patchkit.CheckpointWeightPatch
    assert _alt_loader.load_checkpoint_weight_patches is not patchkit.load_checkpoint_weight_patches
