"""Byte units, defined once for the whole package (binary prefixes, IEC 80000-13)."""

from __future__ import annotations

__all__ = ["KIB", "MIB", "GIB", "TIB"]

KIB = float(2**10)
MIB = float(2**20)
GIB = float(2**30)
TIB = float(2**40)
