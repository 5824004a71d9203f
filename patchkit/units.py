"""Sizes as people read them (one formatter for the whole package)."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: int) -> str:
    """Human-readable binary size: ``"512 B"``, ``"1.5 KiB"``, ``"512 MiB"``, ``"1.18 GiB"``.

    At most three significant digits past the unit change; exact values lose trailing
    zeros. Negative numbers keep their sign.
    """
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1024:
        return f"{n} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB")
    value = float(n)
    k = -1
    # (a value that rounds up to 1024 of a unit is 1 of the next: 1048575 B is "1 MiB")
    while k < 0 or (round(value, _digits(value)) >= 1024 and k < len(units) - 1):
        value /= 1024
        k += 1
    unit = units[k]
    digits = _digits(value)
    text = f"{value:.{digits}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{text} {unit}"


def _digits(value: float) -> int:
    """Decimals for three significant digits of a value in [1, 1024)."""
    return 0 if value >= 100 else 1 if value >= 10 else 2


def _count(n: int, one: str, many: str | None = None) -> str:
    """``"1 patch"``, ``"2 patches"``: ``n`` and the word, singular for one."""
    return f"{n} {one if n == 1 else (many or one + 's')}"
