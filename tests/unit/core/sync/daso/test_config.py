"""DASO's settings: bad values and unknown names are refused, naming them."""

from __future__ import annotations

import pytest

from hvd_plugins.core.sync.daso import DasoConfig, DasoSchedule


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("warmup_epochs", -1, "warmup_epochs=-1 must be >= 0"),
        ("stable_epochs", -1, "stable_epochs=-1 must be >= 0"),
        ("max_global_skips", 0, "max_global_skips=0 must be >= 1"),
        ("skip_reduction_factor", 1, "skip_reduction_factor=1 must be >= 2"),
        ("stability_level", 1.5, r"stability_level=1.5 must be in \[0, 1\)"),
        ("downcast", "int8", "downcast='int8' is not supported"),
        ("sending_chunk_size", 0, "sending_chunk_size=0 must be >= 1"),
        ("average_optimizer_state", "no", "average_optimizer_state='no' must be True or False"),
    ],
)
def test_config_rejects_bad_values(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DasoConfig(**{field: value})


def test_config_from_dict_names_unknown_settings_and_schedule_rejects_bad_length() -> None:
    with pytest.raises(ValueError, match=r"unknown DASO setting\(s\) \['global_skip'\]"):
        DasoConfig.from_any({"global_skip": 4})
    with pytest.raises(ValueError, match="total_epochs=0 must be >= 1"):
        DasoSchedule(DasoConfig(), total_epochs=0)
