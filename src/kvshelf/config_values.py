"""Typed readers of one configuration value, each raising a ValueError that names the key.

Shared by the connector's configuration (:mod:`kvshelf.connector_config`, which reads JSON and
strings from ``kv_connector_extra_config``) and by the classes that check an argument that is
already typed (lazy offload's policies and pending stores). Imports nothing of kvshelf.
"""

from __future__ import annotations

import math
from typing import Any


def require_positive_int(key: str, value: object) -> int:
    """Return ``value`` if it is a positive int, else raise a ValueError naming ``key``.

    Stricter than ``parse_int``: it checks a value that is already typed (a constructor
    argument), so a string or a float is a mistake too. bool is rejected although it is an int
    subclass: ``true`` in a JSON config is a mistake, not the number 1.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def parse_bool(key: str, value: Any) -> bool:
    """Accept a JSON boolean or the strings ``true``/``false`` (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{key} must be a boolean (true or false), got {value!r}")


def parse_int(
    key: str, value: Any, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """Accept an integer or a decimal string; booleans and fractions are rejected."""
    if isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        number = int(value.strip())
    else:
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{key} must be <= {maximum}, got {number}")
    return number


def finite_float(key: str, value: Any, expected: str) -> float:
    """A finite number (or a string holding one); ``expected`` words the error."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be {expected}, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{key} must be {expected}, got {value!r}")
    return number


def parse_positive_float(key: str, value: Any) -> float:
    """Accept a positive number (or a string holding one)."""
    number = finite_float(key, value, "a positive number")
    if number <= 0:
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return number


def parse_str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value.strip()
