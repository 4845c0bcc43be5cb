"""Numbers a person reads: durations and byte counts in the unit their magnitude calls for, with
thousands separators (a step of 4.26 ms, not 4,257.6 us; 15.75 GB, not 15,753.12 MB). JSON output
keeps the raw numbers (seconds, integer bytes); only what is printed for a person goes through here."""

from __future__ import annotations


def duration(seconds: float | None, us_digits: int = 1, scale_of: float | None = None) -> str:
    """'12.3 us' below a millisecond, '4.258 ms' below a second, '19.72 s' above; None: 'n/a'.
    `scale_of` picks the unit from another duration (the larger of a row's, one unit per row)."""
    if seconds is None:
        return "n/a"
    s = float(seconds)
    ref = abs(float(scale_of if scale_of is not None else s))
    if ref >= 1.0:
        return f"{s:,.2f} s"
    if ref >= 1e-3:
        return f"{s * 1e3:,.3f} ms"
    return f"{s * 1e6:,.{us_digits}f} us"


def size(nbytes: float | None, scale_of: float | None = None, digits: int | None = None) -> str:
    """Decimal bytes: '15.75 GB', '34.22 MB', '12.0 KB', '512 B'. `scale_of` picks the unit from
    another number (the larger of a pair printed side by side, so one row keeps one unit);
    `digits` overrides the decimals (2 for GB and MB, 1 for KB)."""
    if nbytes is None:
        return "n/a"
    n = float(nbytes)
    ref = abs(float(scale_of if scale_of is not None else n))
    for div, unit, places in ((1e9, "GB", 2), (1e6, "MB", 2), (1e3, "KB", 1)):
        if ref >= div:
            return f"{n / div:,.{places if digits is None else digits}f} {unit}"
    return f"{n:,.0f} B"
