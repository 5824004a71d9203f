"""Progress of a long load, for :func:`patchkit.inspect_load`'s ``progress=``.

A report of a whole model's sparse load takes seconds to tens of seconds on a CPU (one
layer of Llama-3-8B's shapes: about 0.4 s; 32 of them: about 15 s on these 2-core
machines). ``progress=True`` shows how far it is, one step per ``load_weights`` call: a
progress bar in a Jupyter kernel (ipywidgets, where installed), else one line on stderr:
on a terminal (or in a kernel) a line that rewrites itself (``\r``); elsewhere (a log
file, a pipe) plain lines, each ending in a newline: one every :data:`LOG_EVERY`
seconds of a long load, then the final status, written once. Either appears only once
the load has run for :data:`SHOW_AFTER` seconds, so a short load prints nothing.
``progress=callable`` calls it with a :class:`LoadProgress` after every call instead,
and shows nothing itself.

Imports nothing beyond the standard library until a bar is shown.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import PatchTypeError, brief
from .units import format_bytes

__all__ = ["LOG_EVERY", "SHOW_AFTER", "LoadProgress"]

SHOW_AFTER = 0.5
"""Seconds a load runs before ``progress=True`` shows anything."""
LOG_EVERY = 10.0
"""Off a terminal, ``progress=True`` writes a line at most this often (seconds), and the
final status once at the end: a load shorter than this leaves one line in a log."""
_EVERY = 0.1  # a shown bar is redrawn at most this often (and once at the end)


@dataclass(frozen=True)
class LoadProgress:
    """Where a load stands, after one ``load_weights`` call.

    - ``calls_done``: the calls that have finished (returned or raised), this one included;
    - ``calls``: the calls planned (:func:`patchkit.plan_chunks`); a loader passed as
      ``loader=`` may make more, and then ``calls`` grows with ``calls_done``;
    - ``bytes_done``, ``total_bytes``: the staged bytes of those calls, of all planned calls;
    - ``seconds``: since the load started;
    - ``names``: the checkpoint names the last call was sent;
    - ``failed``: the last call raised (with patchkit's loader no call follows; a loader
      passed as ``loader=`` may catch the error and go on). The final status a bar shows
      says ``failed`` where the load failed: in a call, or between or after its calls (a
      contract check after the last call, a Ctrl-C while the next chunk was staged); not
      where a ``loader=`` caught the error of its last call and returned.
    """

    calls_done: int
    calls: int
    bytes_done: int
    total_bytes: int
    seconds: float
    names: tuple[str, ...]
    failed: bool = False

    @property
    def fraction(self) -> float:
        """The share of the planned bytes staged so far (of the calls, without bytes), in
        ``[0, 1]``; 1.0 for a load that planned no call."""
        if self.total_bytes:
            return min(1.0, self.bytes_done / self.total_bytes)
        return min(1.0, self.calls_done / self.calls) if self.calls else 1.0

    def text(self, label: str = "inspect_load") -> str:
        """One line: ``"inspect_load: 3/12 calls, 1.5 GiB of 6 GiB staged, 4.1 s"``."""
        state = ", failed" if self.failed else ""
        return (
            f"{label}: {self.calls_done}/{self.calls} calls, {format_bytes(self.bytes_done)} of "
            f"{format_bytes(self.total_bytes)} staged, {self.seconds:.1f} s{state}"
        )


def check_progress(progress: Any) -> None:
    """``PatchTypeError`` unless ``progress`` is a bool, ``None`` or a callable that can
    be called with one argument (the :class:`LoadProgress`): checked before anything is
    read or run, so that a callback of the wrong signature (``progress=LoadProgress``,
    the class; a ``lambda:`` of no argument) does not stop a load after its first call,
    with the model half updated. A callable whose signature cannot be read is taken."""
    if progress is None or isinstance(progress, bool):
        return
    if callable(progress):
        try:
            signature = inspect.signature(progress)
        except (TypeError, ValueError):
            return  # (a builtin, say: its call will tell)
        try:
            signature.bind(None)
        except TypeError as e:
            raise PatchTypeError(
                "progress must be a callable taking one argument (a patchkit.LoadProgress), "
                f"but {getattr(progress, '__qualname__', type(progress).__name__)}"
                f"{signature} cannot be called with one ({e}); nothing was loaded",
                reason="progress signature", value=progress,
            ) from None
        return
    raise PatchTypeError(
        "progress must be True (show a bar), False/None (nothing) or a callable taking a "
        f"patchkit.LoadProgress; got {type(progress).__name__}: {brief(progress)}",
        reason="progress type", value=progress,
    )


class Tracker:
    """Counts a load's calls and passes a :class:`LoadProgress` on (see the module
    docstring). ``planned``: the staged bytes of each planned call, in order."""

    def __init__(self, progress: bool | Callable[[LoadProgress], Any] | None,
                 planned: list[int], label: str = "inspect_load") -> None:
        self._callback = progress if callable(progress) else None
        self._show = progress is True
        self._planned = planned
        self._total = sum(planned)
        self._label = label
        self._t0 = time.perf_counter()
        self._done = 0
        self._bytes = 0
        self._view: _View | None = None
        self._last: LoadProgress | None = None
        self._shown = -_EVERY  # when the bar was last redrawn
        # What the callback raised when told of a failed call: the load's own error stays
        # the one raised, and notes this one (see inspect_load).
        self.suppressed: Exception | None = None

    @property
    def active(self) -> bool:
        return self._show or self._callback is not None

    def _state(self, names: tuple[str, ...], failed: bool) -> LoadProgress:
        return LoadProgress(
            calls_done=self._done, calls=max(len(self._planned), self._done),
            bytes_done=self._bytes, total_bytes=max(self._total, self._bytes),
            seconds=time.perf_counter() - self._t0, names=names, failed=failed,
        )

    def call_end(self, names: tuple[str, ...], nbytes: int, failed: bool) -> None:
        """One ``load_weights`` call of ``nbytes`` staged bytes has finished."""
        self._done += 1
        self._bytes += nbytes
        state = self._last = self._state(names, failed)
        if self._callback is not None:
            if not failed:
                self._callback(state)  # (it may raise, to stop the load)
            else:  # (the call raised: that error is the load's, not what this raises)
                try:
                    self._callback(state)
                except Exception as e:
                    self.suppressed = e
        if self._show and state.seconds - self._shown >= _EVERY:
            if self._view is None and state.seconds >= SHOW_AFTER:
                self._view = self._shown_safely(lambda: _View.open(self._label))
            if self._view is not None:
                self._shown_safely(lambda: self._view.update(state, self._label))
                self._shown = state.seconds

    def close(self, failed: bool = False) -> None:
        """The load is over (``failed``: it raised, in a call or not): a bar that was shown
        says how it ended (how the load ended, not its last call: a ``loader=`` may have
        caught that call's error)."""
        if self._view is not None and self._last is not None:
            last = self._state(self._last.names, failed)
            self._shown_safely(lambda: self._view.finish(last, self._label))
            self._view = None

    def _shown_safely(self, show: Callable[[], Any]) -> Any:
        """``show()``, or ``None`` when it raised: a display that fails (no stderr, one
        without ``flush``, a kernel whose front end is gone) stops showing, and never
        stops the load it shows."""
        try:
            return show()
        except Exception:
            self._show = False
            self._view = None
            return None


class _View:
    """A shown bar: an ipywidgets one in a Jupyter kernel, else a line on stderr."""

    @staticmethod
    def open(label: str) -> _View:
        if _in_kernel():
            try:
                return _WidgetView(label)
            except ImportError:  # no ipywidgets: the text line works in a notebook too
                return _TextView()
        return _TextView() if _is_terminal(sys.stderr) else _LogView()

    def update(self, state: LoadProgress, label: str) -> None:
        raise NotImplementedError

    def finish(self, state: LoadProgress, label: str) -> None:
        raise NotImplementedError


class _TextView(_View):
    def __init__(self) -> None:
        self._width = 0

    def _write(self, line: str, end: str) -> None:
        pad = " " * max(0, self._width - len(line))
        self._width = len(line)
        try:
            sys.stderr.write("\r" + line + pad + end)
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # a closed, broken or missing
            pass  # stderr (None, or one without flush): the load goes on

    def update(self, state: LoadProgress, label: str) -> None:
        self._write(state.text(label), "")

    def finish(self, state: LoadProgress, label: str) -> None:
        self._write(state.text(label), "\n")


class _LogView(_View):
    """Off a terminal (a log file, a pipe): no ``\r``; a line every :data:`LOG_EVERY`
    seconds, then the final status, unless the last line written already said it."""

    def __init__(self) -> None:
        self._said: LoadProgress | None = None

    def _write(self, state: LoadProgress, label: str) -> None:
        self._said = state
        try:
            sys.stderr.write(state.text(label) + "\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # a closed, broken or missing
            pass  # stderr (None, or one without flush): the load goes on

    def update(self, state: LoadProgress, label: str) -> None:
        since = state.seconds - (self._said.seconds if self._said is not None else 0.0)
        if since >= LOG_EVERY:
            self._write(state, label)

    def finish(self, state: LoadProgress, label: str) -> None:
        said = self._said
        if said is None or (said.calls_done, said.calls, said.bytes_done, said.failed) != (
                state.calls_done, state.calls, state.bytes_done, state.failed):
            self._write(state, label)


class _WidgetView(_View):
    def __init__(self, label: str) -> None:
        import ipywidgets as W
        from IPython.display import display

        # (the label's own width: ipywidgets' default description width cut
        # "inspect_load" to "inspect_lo…" in JupyterLab)
        self._bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, description=label,
                                    style={"description_width": "initial"})
        self._text = W.Label()
        display(W.HBox([self._bar, self._text]))

    def update(self, state: LoadProgress, label: str) -> None:
        self._bar.value = state.fraction
        self._text.value = state.text(label).split(": ", 1)[1]

    def finish(self, state: LoadProgress, label: str) -> None:
        self.update(state, label)
        self._bar.bar_style = "danger" if state.failed else "success"


def _is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (False for a file, a pipe, a closed stream)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def _in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (IPython already imported, with a kernel)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    return shell is not None and getattr(shell, "kernel", None) is not None
