"""The one exception family patchkit raises.

Every error is also the builtin type the contract names (``ValueError``, ``TypeError``,
``NotImplementedError``), so code written against vLLM's loader that catches those keeps
working, and code that wants only patchkit's errors catches :class:`PatchError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .inspect import LoadReport

__all__ = [
    "ContractViolation",
    "PatchError",
    "PatchTypeError",
    "PatchValueError",
]


class PatchError(Exception):
    """Base of every error patchkit raises about patches or loaders.

    Attributes a caller can rely on (``None`` where they do not apply):

    - ``position``: index of the offending patch in the caller's input order;
    - ``name``: that patch's checkpoint name (both ``None`` also where no one patch is
      known to be at fault, e.g. an op a sparse load refuses whose source is no patch,
      in a ``load_weights`` call of several patches: the message then says so);
    - ``reason``: a short machine-readable reason, e.g. ``"NaN"``, ``"out-of-range"``,
      ``"duplicate"``, ``"mixed"``, ``"overlapping runtime views"``;
    - ``value``: one offending value (an index, a count, a dtype, an op name).

    An error that :func:`~patchkit.inspect_load` raises also carries ``report``, the
    :class:`~patchkit.LoadReport` of what the load did before it failed (it is declared
    here for type checkers; an error from any other call has no such attribute).
    """

    report: LoadReport  # (set by inspect_load on the errors it raises)

    def __init__(
        self,
        message: str,
        *,
        position: int | None = None,
        name: str | None = None,
        reason: str | None = None,
        value: object = None,
    ) -> None:
        super().__init__(message)
        self.position = position
        self.name = name
        self.reason = reason
        self.value = value


class PatchValueError(PatchError, ValueError):
    """A patch, or an argument of the call, has a bad value: a :class:`PatchError`
    (``position``, ``name``, ``reason``, ``value``) that is also a ``ValueError``."""


class PatchTypeError(PatchError, TypeError):
    """A patch, or an argument of the call, has a bad type (a dtype, an index dtype): a
    :class:`PatchError` (``position``, ``name``, ``reason``, ``value``) that is also a
    ``TypeError``."""


class ContractViolation(PatchError, NotImplementedError):
    """A model's ``load_weights`` did something a sparse (NaN-masked) load cannot support
    (or a transactional or inspected one cannot save: a write through a view whose
    elements overlap, a tensor subclass), or returned anything but the names it loaded
    (an iterable of str) or ``None``."""


def where(position: int | None, name: str | None) -> str:
    """``"patch 3 ('model.norm.weight')"``: how messages name a patch (one given alone,
    ``position`` None: ``"patch 'model.norm.weight'"``, or ``"patch (name 5)"`` for a name
    that is no str, which would read as a position; such a name is shown as
    :func:`brief` shows it, a str name as :func:`quoted` does)."""
    shown = quoted(name) if isinstance(name, str) else brief(name)
    if position is None:
        return f"patch {shown}" if isinstance(name, str) else f"patch (name {shown})"
    return f"patch {position} ({shown})"


def add_note(exc: BaseException, text: str) -> None:
    """Add ``text`` to ``exc``'s notes (PEP 678): ``exc.add_note(text)`` on Python 3.11+;
    on 3.10, which has no ``add_note``, appended to ``exc.__notes__`` (a list of str, made
    where there is none), as 3.11's method does, so code that reads ``__notes__`` finds
    the same list (a traceback printer that reads them shows it: IPython 8.14+'s does,
    3.10's own does not). An exception that takes no attribute (a ``__setattr__`` that
    refuses), or whose ``__notes__`` is no list, gets no note there: never an error of
    its own in place of the one being raised."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(text)
        return
    try:
        notes = getattr(exc, "__notes__", None)
        if notes is None:
            notes = exc.__notes__ = []  # type: ignore[attr-defined]
        if isinstance(notes, list):
            notes.append(text)
    except Exception:  # (the note is dropped, as 3.10 dropped every note before)
        pass


# What a model's load_weights must do, for the errors that find a model without one.
LOAD_WEIGHTS_DOES = (
    "takes a list of (checkpoint name, tensor) pairs, writes each into the model and "
    "returns the names it loaded (docs/CONTRACT.md; patchkit.toymodels.PlainModel is a "
    "minimal one)"
)


# (longer than any real checkpoint or runtime tensor name: those are shown whole)
_NAME_MOST = 200


def quoted(name: object) -> str:
    """A name (a patch's, a runtime tensor's) as a message shows it: its ``repr``, whole
    up to 200 characters, past that cut as :func:`brief` cuts (a megabyte name makes no
    megabyte message; ``.name`` on the error holds it whole)."""
    return brief(name, _NAME_MOST)


def brief(value: object, most: int = 100, *, text: bool = False) -> str:
    """``repr(value)`` (``str(value)`` with ``text``) as a message shows an offending value:
    cut to ``most`` characters with ``"..."`` after (a list of a million numbers, a
    megabyte string), and never an error of its own: an int too long for Python to print
    (over 4300 digits) is ``"<a 16610-bit int>"``, and anything else that cannot be shown
    (a number holding such an int, an object whose ``__repr__`` fails) its type in angle
    brackets."""
    try:
        shown = str(value) if text else repr(value)
    except Exception:
        if isinstance(value, int):
            return f"<a {value.bit_length()}-bit int>"
        return f"<a {type(value).__name__}>"
    return shown if len(shown) <= most else shown[:most] + "..."
