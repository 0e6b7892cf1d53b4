"""What commands print: aligned two-column tables and the numbers in them, in one style."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

GB = 1e9


def print_table(rows: Mapping[str, Any] | Iterable[tuple[str, Any]], *, file=None) -> None:
    """`key  value` lines with the keys padded to one width (an empty key: a blank line)."""
    rows = list(rows.items()) if isinstance(rows, Mapping) else list(rows)
    if not rows:
        return
    width = max(len(str(k)) for k, _ in rows)
    out = file or sys.stdout
    for key, value in rows:
        print(f"{key:<{width}}  {value}" if key != "" else "", file=out)


def gib(n: float) -> str:
    """Bytes in GiB (2^30), as memory is allocated."""
    return f"{n / 2**30:.2f} GiB"


def gb(n: float) -> str:
    """Bytes in GB (10^9), as accelerator data sheets count them; MB below 10 MB."""
    v = n / GB
    if v >= 0.01:
        return f"{v:,.0f} GB" if v >= 1000 else f"{v:.1f} GB" if v >= 1 else f"{v:.2f} GB"
    return f"{n / 1e6:.3g} MB"


def count(n: float) -> str:
    """A count with a K, M, B or T suffix, three significant digits."""
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:g}"


def sci(x: float) -> str:
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def duration(days: float) -> str:
    for unit, per_day in (("days", 1), ("hours", 24), ("minutes", 24 * 60)):
        if days * per_day >= 1:
            return f"{days * per_day:.3g} {unit}"
    return f"{days * 86400:.3g} seconds"


def money(x: float) -> str:
    return f"${x:,.0f}" if x >= 100 else f"${x:.2f}"
