"""Generated sections of the docs' Markdown pages: text between ``<!-- NAME:start ... -->`` and
``<!-- NAME:end -->``, rewritten by a benchmark's report (``--page``) and nothing else. No torch
or vLLM import."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path


def end_marker(name: str) -> str:
    """The line that ends section ``name``."""
    return f"<!-- {name}:end -->"


def replace_section(page: Path, name: str, render: Callable[[], str]) -> None:
    """Replace the text between section ``name``'s markers of ``page`` with what ``render``
    returns (called once the markers are found); keep the markers.

    Raises:
        ValueError: The markers are missing.
    """
    text = page.read_text()
    start = re.compile(rf"^<!-- {re.escape(name)}:start.*-->$", re.MULTILINE).search(text)
    end = text.find(end_marker(name))
    if start is None or end < start.end():
        raise ValueError(f"{page}: no '<!-- {name}:start ... -->' ... '{end_marker(name)}' markers")
    page.write_text(text[: start.end()] + "\n" + render() + text[end:])
