"""Which loader the contract suite tests, and the fixtures every contract test uses.

The suite in ``tests/contract`` pins CONTRACT.md. It runs against patchkit by default and
against any other implementation with the same signature, e.g. vLLM's::

    pytest tests/contract \
      --loader=vllm.model_executor.model_loader.checkpoint_weight_patch:load_checkpoint_weight_patches

``--loader=module:function`` wins over the environment variable ``PATCHKIT_LOADER``
(same syntax); with neither, patchkit's loader is under test. The ``Patch`` fixture is the
selected module's ``CheckpointWeightPatch`` when it has one, else patchkit's.

Tests marked ``patchkit_only`` pin behaviour only patchkit promises (the **[patchkit]**
clauses of CONTRACT.md, ``plan_chunks``, error attributes, ``transactional``, tied
weights, the strict §4 checks, the rebinding check); they are skipped when another
loader is selected.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pytest
import torch
from torch.utils._device import DeviceContext, _device_constructors

import patchkit

pytest_plugins = ["pytester"]

ENV_VAR = "PATCHKIT_LOADER"
DEVICE_VAR = "PATCHKIT_TEST_DEVICE"
DEFAULT_LOADER = "patchkit:load_checkpoint_weight_patches"
PATCHKIT_ONLY = "patchkit_only"


@dataclass(frozen=True)
class SelectedLoader:
    """The implementation under test."""

    spec: str
    function: Callable
    patch_type: type
    is_patchkit: bool


def resolve_loader(spec: str | None, *, search_path: Iterable[str] = ()) -> SelectedLoader:
    """Turn ``"module:function"`` (``None``/empty: patchkit's) into the loader under test.

    ``function`` may be dotted (``module:Class.method``). When ``module`` cannot be
    imported as it stands, it is tried again with ``search_path`` (the rootdir, the
    current directory) in front of ``sys.path``. A bad spec is a usage error.
    """
    spec = (spec or "").strip() or DEFAULT_LOADER
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise pytest.UsageError(
            f"--loader/{ENV_VAR} must look like 'package.module:function', got {spec!r}"
        )
    module = _import(module_name, list(search_path), spec)
    function: object = module
    for part in attr.split("."):
        try:
            function = getattr(function, part)
        except AttributeError:
            raise pytest.UsageError(
                f"--loader/{ENV_VAR} {spec!r}: {module_name} has no attribute {attr!r}"
            ) from None
    if not callable(function):
        raise pytest.UsageError(f"--loader/{ENV_VAR} {spec!r}: {attr!r} is not callable")
    patch_type = getattr(module, "CheckpointWeightPatch", None)
    if not isinstance(patch_type, type):
        patch_type = patchkit.CheckpointWeightPatch
    return SelectedLoader(
        spec=spec,
        function=function,
        patch_type=patch_type,
        is_patchkit=function is patchkit.load_checkpoint_weight_patches,
    )


def _import(module_name: str, search_path: list[str], spec: str):
    """The module ``module_name``, tried again with ``search_path`` in front of
    ``sys.path`` when it is not found; a usage error naming the spec when it is not found
    either way, or when importing it raises (a name it imports is missing, a syntax
    error, an exception of its own): never a pytest internal error."""
    module = _try_import(module_name, spec)
    if module is not None:
        return module
    extra = [p for p in search_path if p not in sys.path]
    sys.path[:0] = extra
    try:
        module = _try_import(module_name, spec)
    finally:
        for p in extra:
            sys.path.remove(p)
    if module is None:
        raise pytest.UsageError(f"--loader/{ENV_VAR} {spec!r}: No module named {module_name!r}")
    return module


def _try_import(module_name: str, spec: str):
    """``module_name`` imported, ``None`` where it (or a package it is in) is not found."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name + ".").startswith(e.name + "."):
            return None  # the module itself, or its package: not on the path
        failed = e
    except Exception as e:  # (its own code raised while it was imported)
        failed = e
    raise pytest.UsageError(
        f"--loader/{ENV_VAR} {spec!r}: importing {module_name} failed: "
        f"{type(failed).__name__}: {failed}"
    ) from None


_SELECTED = pytest.StashKey[SelectedLoader]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        action="store",
        default=None,
        metavar="DEVICE",
        help=(
            f"default torch device for every test under tests/ (default: ${DEVICE_VAR}, "
            "else cpu); tensors a test places explicitly stay where it puts them"
        ),
    )
    parser.addoption(
        "--loader",
        action="store",
        default=None,
        metavar="MODULE:FUNCTION",
        help=(
            "load_checkpoint_weight_patches implementation the contract suite tests "
            f"(default: ${ENV_VAR}, else {DEFAULT_LOADER})"
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{PATCHKIT_ONLY}: behaviour that only patchkit promises "
        "(skipped when another loader is under test)",
    )
    spec = config.getoption("--loader") or os.environ.get(ENV_VAR) or DEFAULT_LOADER
    config.stash[_SELECTED] = resolve_loader(
        spec, search_path=(str(config.rootpath), os.getcwd())
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    selected = config.stash[_SELECTED]
    return [
        f"contract loader under test: {selected.spec}",
        f"default torch device for tests: {_test_device(config)}",
    ]


def _test_device(config: pytest.Config) -> str:
    return config.getoption("--device") or os.environ.get(DEVICE_VAR) or "cpu"


def _process_state() -> dict[str, object]:
    return {
        "recursion limit": sys.getrecursionlimit(),
        "grad mode": torch.is_grad_enabled(),
        "default dtype": torch.get_default_dtype(),
        "torch function modes": torch._C._len_torch_function_stack(),
        "torch dispatch modes": torch._C._len_torch_dispatch_stack(),
        "Tensor.copy_": torch.Tensor.copy_,
        "SIGINT handler": signal.getsignal(signal.SIGINT),
        "gc enabled": gc.isenabled(),
    }


@pytest.fixture(autouse=True)
def _process_state_left_as_found():
    """Every test leaves the process as it found it: what a load installs (torch function
    and dispatch modes, signal handlers held off, the collector paused, no-grad) is gone
    once it returns or raises, whatever the test made it do. A test that leaves one of
    these changed fails (an error at its teardown, naming what changed), and what can be
    put back is, so that the tests after it run as they would alone."""
    before = _process_state()
    yield
    after = _process_state()
    changed = {k: (before[k], after[k]) for k in before if after[k] != before[k]}
    if not changed:
        return
    sys.setrecursionlimit(before["recursion limit"])
    torch.set_grad_enabled(before["grad mode"])
    torch.set_default_dtype(before["default dtype"])
    torch.Tensor.copy_ = before["Tensor.copy_"]
    signal.signal(signal.SIGINT, before["SIGINT handler"])
    (gc.enable if before["gc enabled"] else gc.disable)()
    pytest.fail(f"the test left the process changed (before, after): {changed}")


@pytest.fixture(autouse=True)
def _default_device(request: pytest.FixtureRequest):
    """Run the test with ``--device`` as torch's default device (``cpu``: nothing changes).

    On a GPU machine ``pytest tests --device cuda`` runs the whole suite with every tensor
    that a test (or a model it builds) creates without naming a device, or a CPU
    generator to draw from, on the GPU.
    """
    device = _test_device(request.config)
    if device == "cpu":
        yield
        return
    with _DefaultDevice(torch.device(device)):
        yield


class _DefaultDevice(DeviceContext):
    """``with torch.device(d):``, except that a factory call drawing from a CPU
    ``torch.Generator`` makes a CPU tensor, as it would without a default device (torch
    itself refuses the mix). So seeded tests draw the same numbers everywhere, and what a
    test builds from them stays on the CPU, next to the CPU tensors it is compared with.
    ``torch.get_default_device()`` sees it (threads a test starts can pass it on).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CONSTRUCTORS and kwargs.get("device") is None:
            gen = kwargs.get("generator")
            cpu_draw = gen is not None and gen.device.type == "cpu"
            kwargs = {**kwargs, "device": torch.device("cpu") if cpu_draw else self.device}
        return func(*args, **kwargs)


_CONSTRUCTORS = _device_constructors()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = config.stash[_SELECTED]
    if selected.is_patchkit:
        return
    skip = pytest.mark.skip(
        reason=f"patchkit-only behaviour; the loader under test is {selected.spec}"
    )
    for item in items:
        if item.get_closest_marker(PATCHKIT_ONLY) is not None:
            item.add_marker(skip)


# Session-scoped so that hypothesis tests can use them (they never change within a run).


@pytest.fixture(scope="session")
def selected_loader(pytestconfig: pytest.Config) -> SelectedLoader:
    return pytestconfig.stash[_SELECTED]


@pytest.fixture(scope="session")
def load(selected_loader: SelectedLoader) -> Callable:
    """The ``load_checkpoint_weight_patches`` under test."""
    return selected_loader.function


@pytest.fixture(scope="session")
def Patch(selected_loader: SelectedLoader) -> type:
    """The ``CheckpointWeightPatch`` of the implementation under test."""
    return selected_loader.patch_type


@pytest.fixture(scope="session")
def patchkit_selected(selected_loader: SelectedLoader) -> bool:
    """True when patchkit's own loader is under test (its extensions can be checked)."""
    return selected_loader.is_patchkit


# -- a model and a fault that several test files use ---------------------------------------


class Interleaved(torch.nn.Module):
    """``gate`` into rows 0, 2, 4, 6 of ``gate_up`` and ``up`` into rows 1, 3, 5, 7; ``x``
    through the transposed view ``v.t()[1:3]``, which is the box ``v[:, 1:3]``: writes
    whose views are not row-major boxes."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.v = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)

    def load_weights(self, weights):
        for n, t in weights:
            if n == "x":
                self.v.data.t()[1:3].copy_(t)
            else:
                self.gate_up.data[(0 if n == "gate" else 1)::2].copy_(t)
        return {n for n, _ in weights}


@pytest.fixture
def interleaved() -> Interleaved:
    """A fresh :class:`Interleaved` model (all zeros)."""
    return Interleaved()


@pytest.fixture
def unrestorable(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """``unrestorable(target)``: from then on (for the test), a rollback cannot write the
    saved regions of ``target`` back (``OSError``); every other region restores as usual."""
    from patchkit import intercept

    def make(target: str) -> None:
        real = intercept.SavedRegion.restore

        def restore(self):
            if self.target == target:
                raise OSError(f"{target} cannot be written")
            real(self)

        monkeypatch.setattr(intercept.SavedRegion, "restore", restore)

    return make
