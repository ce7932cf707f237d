"""Comma-separated option values (``--streams 1,64,500``), parsed as ``argparse`` types, for every benchmark."""

from __future__ import annotations


def comma_ints(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item]


def comma_floats(text: str) -> list[float]:
    return [float(item) for item in text.split(",") if item.strip()]


def comma_names(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]
