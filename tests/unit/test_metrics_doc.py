"""docs/metrics.md is generated from kvshelf.metrics and lists every declared metric."""

from __future__ import annotations

from pathlib import Path

from kvshelf.metrics import ALL_GROUPS, CONNECTOR_GROUPS
from kvshelf.metrics_doc import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_committed_page_is_what_the_declarations_render() -> None:
    assert DOC.read_text() == render(), (
        "docs/metrics.md is stale: python -m kvshelf.metrics_doc > docs/metrics.md"
    )


def test_page_lists_every_declared_metric() -> None:
    text = DOC.read_text()
    for group in ALL_GROUPS:
        prefix = "kvshelf_connector_" if group in CONNECTOR_GROUPS else "kvshelf_"
        for metric in group:
            assert f"`{prefix}{metric.name}" in text, metric.name
