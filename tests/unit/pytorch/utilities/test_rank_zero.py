"""Warnings on ranks above zero: not displayed, still raised when the filters say so."""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator

import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from hvd_plugins.pytorch.utilities import rank_zero


@pytest.fixture
def rank_restored() -> Iterator[None]:
    rank = rank_zero_only.rank
    yield
    rank_zero.follow_rank(rank)


def _shown(message: str) -> str:
    stream = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown_by = warnings.showwarning
        if shown_by is not rank_zero._drop_warning:  # write where the test can read it
            warnings.showwarning = lambda *args: stream.write(warnings.formatwarning(*args[:4]))
        warnings.warn(message, UserWarning, stacklevel=1)
    return stream.getvalue()


@pytest.mark.usefixtures("rank_restored")
def test_ranks_above_zero_display_no_warnings_but_still_raise_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(rank_zero.ALL_RANK_WARNINGS_ENV, raising=False)
    rank_zero.follow_rank(1)
    assert rank_zero_only.rank == 1
    assert _shown("from rank 1") == ""
    with warnings.catch_warnings(), pytest.raises(UserWarning, match="escalated"):
        warnings.simplefilter("error")
        warnings.warn("escalated", UserWarning, stacklevel=1)
    rank_zero.follow_rank(0)
    assert "from rank 0" in _shown("from rank 0")


@pytest.mark.usefixtures("rank_restored")
def test_all_rank_warnings_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rank_zero.ALL_RANK_WARNINGS_ENV, "1")
    rank_zero.follow_rank(1)
    assert "from rank 1" in _shown("from rank 1")
