"""How numbers and tables are shown: byte sizes, and rich tables printed whole.

rich fits a table to the console, and a console that is not a terminal (a log file, CI) is 80 columns
wide, so a wide table loses its right edge and its cells turn into "optim…". ``print_table`` prints a
table at its natural width instead, wherever the output goes.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
DECIMAL = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))  # as hardware is sold


def size(n: float, decimal: bool = False) -> str:
    """``n`` bytes in the largest unit that keeps the number >= 1: '12.30 MiB' (or '12.90 MB')."""
    for unit, step in DECIMAL if decimal else BINARY:
        if n >= step:
            return f"{n / step:,.2f} {unit}"
    return f"{n:,.0f} B"


def mib(n: float) -> str:
    """``n`` bytes as MiB, no unit: a cell of a column headed MiB."""
    return f"{n / 2**20:,.2f}"


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` at its natural width, however wide the console says it is."""
    natural = console.measure(table, options=console.options.update_width(1_000_000)).maximum
    width = console.width
    console.width = max(width, natural)
    try:
        console.print(table)
    finally:
        console.width = width


UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, unit: str = "b") -> float:
    """'5GB', '500MB', '24.5GiB', '80' (in ``unit``) -> bytes. Decimal units as devices and Hugging Face count."""
    lowered = text.strip().lower()
    suffix = next((u for u in sorted(UNITS, key=len, reverse=True) if lowered.endswith(u)), "")
    number = lowered.removesuffix(suffix).strip() if suffix else lowered
    try:
        return float(number) * UNITS[suffix or unit]
    except ValueError:
        raise ValueError(f"{text!r} is not a size. HINT: write e.g. 5GB, 500MB or 24GiB.") from None


def gigabytes(text: str) -> float:
    """'80GB', '80', '24.5gb' (a bare number in decimal GB, as devices are sold) -> bytes."""
    return parse_size(text, unit="gb")
