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
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    digits = 0 if value >= 100 else 1 if value >= 10 else 2
    text = f"{value:.{digits}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{text} {unit}"
