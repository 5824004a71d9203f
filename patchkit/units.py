"""Sizes as people read them (one formatter for the whole package)."""

from __future__ import annotations

import decimal
import math
import numbers

from .errors import brief

__all__ = ["format_bytes"]

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")
_TOP = 1024 ** (len(_UNITS) + 1)  # 1024 of the last unit: no unit left to write it in


def shown_name(name: str) -> str:
    """``name`` as text any display takes: each character that is not printable (a
    control character: a ``\\r`` would rewrite the line it is shown on, a ``\\n`` break
    a title; a format character such as U+202E, which reverses what follows; a lone
    surrogate, which neither a Jupyter message nor matplotlib's fonts take) written as
    ``repr`` writes it, ``\\r``, ``\\u202e``, ``\\ud800``; every other character as it
    is. ``name`` itself when it needs none (the common case: one check). Terminal output
    (``python -m patchkit inspect``) escapes names the same way."""
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)


def distinct_name(text: str) -> str:
    """``text`` (a name, metadata, a path) as a display writes it so that no two strings
    read the same and nothing moves the cursor, colours a terminal or fakes a line:
    itself when it is plain (printable, no backslash, not opening with a quote, not
    empty, no blank at either end), else its ``repr`` (quoted, every non-printable
    character escaped: ``'w '`` beside ``w``, ``'a\\nb'`` beside ``'a\\\\nb'``)."""
    if (text.isprintable() and "\\" not in text and not text.startswith(("'", '"'))
            and text and text == text.strip()):
        return text
    return repr(text)  # (also an empty name, or one with blanks at an end: 'w ')


def message_of(error: BaseException) -> str:
    """``str(error)``, or ``<exception str() failed>`` (as Python's own traceback writes
    it) for an exception whose ``__str__`` raises: a user's exception may raise
    anything there, and what shows an error must not fail on it."""
    try:
        return str(error)
    except Exception:
        return "<exception str() failed>"


def shown_text(text: str) -> str:
    """``text`` (lines of it: its newlines kept) with each lone surrogate written as its
    escape, ``\\ud800``: what a Jupyter message can carry."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``"512 B"``, ``"1.5 KiB"``, ``"512 MiB"``, ``"1.18 GiB"``.

    ``n`` is a number of bytes. An int (a numpy int too) below 1024 is written exactly
    (``"1023 B"``). From 1 KiB on, the number is written in the largest binary unit
    (KiB, MiB, GiB, TiB, PiB, EiB, ZiB, YiB) that keeps it below 1024, rounded to two
    decimals below 10, one below 100 and none from 100 on, trailing zeros dropped: three
    significant digits, or four from 1000 to 1023 of a unit (``"1000 KiB"``). A number
    that rounds up to 1024 of a unit is 1 of the next (1048575 B is ``"1 MiB"``). From
    1024 YiB on (no unit is left) it is ``m e k YiB`` with a mantissa of three
    significant digits (``10**30`` is ``"8.27e5 YiB"``). A float (a tick on a plot's
    axis) is taken too and rounded the same way below 1 KiB as well (``1.5`` is
    ``"1.5 B"``, ``204.8`` is ``"205 B"``). An int is rounded exactly, however large, and a
    tie to the even digit (1152 B, 1.125 KiB, is ``"1.12 KiB"``; 1153 B is ``"1.13 KiB"``).
    Negative numbers keep their sign, except those that round to ``"0 B"`` (``-0.0``,
    ``-0.004``).

    ``bool`` and anything that is not a real number raise ``TypeError``; NaN and
    infinities raise ``ValueError``.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(
            f"format_bytes: n must be a number of bytes (an int or a float), got "
            f"{type(n).__name__}: {brief(n)}"
        )
    if isinstance(n, numbers.Integral):
        n = int(n)
    else:
        n = float(n)
        if not math.isfinite(n):
            raise ValueError(f"format_bytes: n must be a finite number of bytes, got {n!r}")
        n += 0.0  # (-0.0 is 0.0)
    if n < 0:
        text = format_bytes(-n)
        return text if text == "0 B" else "-" + text  # (a value that rounds to 0 has no sign)
    if isinstance(n, int) and n < 1024:
        return f"{n} B"
    if n < _TOP:
        with decimal.localcontext() as ctx:
            # An int is divided exactly (a Decimal of 200 digits holds n / 1024**8 for any
            # n below _TOP, where a float would round an int past 2**53: 9 * 2**57 + 1
            # bytes is just above 1.125 EiB, so "1.13 EiB"); a float as it is.
            ctx.prec, ctx.rounding = 200, decimal.ROUND_HALF_EVEN
            value: float | decimal.Decimal = decimal.Decimal(n) if isinstance(n, int) else n
            k = -1  # the unit: bytes, then _UNITS[k]
            # (a value that rounds up to 1024 of a unit is 1 of the next: 1048575 B is
            # "1 MiB")
            while round(value, _digits(value)) >= 1024 and k < len(_UNITS) - 1:
                value /= 1024
                k += 1
            if round(value, _digits(value)) < 1024:
                text = f"{value:.{_digits(value)}f}"
                if "." in text:
                    text = text.rstrip("0").rstrip(".")
                return f"{text} {'B' if k < 0 else _UNITS[k]}"
    return f"{_scientific(n, 1024 ** len(_UNITS))} {_UNITS[-1]}"


def _digits(value: float | decimal.Decimal) -> int:
    """Decimals for three significant digits of a value in [1, 1024)."""
    return 0 if value >= 100 else 1 if value >= 10 else 2


def _scientific(n: float, unit: int) -> str:
    """``n / unit`` (at least 1000) as ``"<mantissa>e<exponent>"``, the mantissa rounded to
    three significant digits, trailing zeros dropped: ``"8.27e5"``. Exact for an int of
    any size (no float conversion that could overflow)."""
    with decimal.localcontext() as ctx:
        # digits enough for the quotient exactly: n's own (an int, or a float this large,
        # is a whole number) and the 80 decimals that dividing by 1024**8 adds
        ctx.prec = decimal.Decimal(n).adjusted() + 100
        ctx.Emax = decimal.MAX_EMAX
        ctx.rounding = decimal.ROUND_HALF_EVEN
        q = decimal.Decimal(n) / unit
        e = q.adjusted()
        m = q.scaleb(-e).quantize(decimal.Decimal("0.01"))
        if m >= 10:  # 9.995 rounds to 10.00: one more power of ten
            m, e = (m / 10).quantize(decimal.Decimal("0.01")), e + 1
    text = f"{m:f}".rstrip("0").rstrip(".")
    return f"{text}e{e}"


def _count(n: int, one: str, many: str | None = None) -> str:
    """``"1 patch"``, ``"2 patches"``: ``n`` and the word, singular for one."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _percent_digits(x: float) -> str:
    """``x`` (a fraction) as a percentage of 3 significant digits, without the sign:
    never "100" for less than all of it (">99.9")."""
    text = f"{100 * x:.3g}"
    return ">99.9" if x < 1 and text == "100" else text
