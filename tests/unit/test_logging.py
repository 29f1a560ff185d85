"""The package's reports reach stderr by default, and an application's or pytest's handlers too."""

from __future__ import annotations

import logging
import sys

import pytest

import hvd_plugins


def test_reports_propagate_so_handlers_configured_later_receive_them(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hvd_plugins"):
        logging.getLogger("hvd_plugins.core.comm").info("route chosen: ring")
    assert [record.getMessage() for record in caplog.records] == ["route chosen: ring"]


def test_the_fallback_prints_only_while_the_root_logger_has_no_handler(capsys: pytest.CaptureFixture[str]) -> None:
    handler = hvd_plugins._FallbackStderrHandler()
    handler.setFormatter(logging.Formatter("hvd_plugins: %(message)s"))
    record = logging.LogRecord("hvd_plugins.x", logging.INFO, __file__, 1, "hello", None, None)
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        handler.stream = sys.stderr
        handler.emit(record)
    finally:
        root.handlers[:] = saved
    assert capsys.readouterr().err == "hvd_plugins: hello\n"
    configured = logging.NullHandler()
    root.addHandler(configured)
    try:
        handler.emit(record)
    finally:
        root.removeHandler(configured)
    assert capsys.readouterr().err == ""
