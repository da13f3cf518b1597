"""Sizes in the operator's words: bytes with a binary unit, one way everywhere."""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def bytes_text(n: float) -> str:
    """`512 B`, `40.0 KiB`, `75.9 GiB`, `1.0 PiB`."""
    value = float(n)
    for unit in UNITS:
        if abs(value) < 1024 or unit == UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
