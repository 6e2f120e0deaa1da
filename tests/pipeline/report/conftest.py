"""What the report's tests share."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure


@pytest.fixture
def figures(monkeypatch):
    """The figures drawn and saved during a test, kept for their axes (saved as usual)."""
    kept = []
    savefig = Figure.savefig

    def keep(self, *args, **kwargs):
        kept.append(self)
        return savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return kept
