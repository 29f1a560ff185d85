from __future__ import annotations

from pathlib import Path

import pytest

from hvd_plugins.core.backend.loop_cadence import IDLE_ENV, IDLE_LOOP_PATCH, choose_loop_cadence


def marker(tmp_path: Path, *patches: str) -> Path:
    path = tmp_path / "patches"
    path.write_text("".join(f"{name}.patch\n" for name in patches))
    return path


def test_the_idle_cadence_is_set_unless_the_user_chose_one(tmp_path: Path) -> None:
    built = marker(tmp_path, "0008-sleeping-synchronize-wait", IDLE_LOOP_PATCH)
    env: dict[str, str] = {}
    line = choose_loop_cadence(env, built)
    assert env == {IDLE_ENV: "100"}
    assert "every 1 ms while a collective is queued" in line and "every 100 ms while none is" in line
    env = {IDLE_ENV: "20", "HOROVOD_CYCLE_TIME": "5"}
    line = choose_loop_cadence(env, built)
    assert env[IDLE_ENV] == "20" and "every 5 ms while" in line and "every 20 ms while none" in line


def test_zero_restores_a_round_every_cycle_and_bad_values_are_named(tmp_path: Path) -> None:
    built = marker(tmp_path, IDLE_LOOP_PATCH)
    assert "work or not" in choose_loop_cadence({IDLE_ENV: "0"}, built)
    with pytest.raises(ValueError, match="HOROVOD_IDLE_CYCLE_TIME='soon'"):
        choose_loop_cadence({IDLE_ENV: "soon"}, built)


def test_another_build_is_left_alone_and_said_so(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    line = choose_loop_cadence(env, marker(tmp_path, "0008-sleeping-synchronize-wait"))
    assert env == {} and "work or not" in line and IDLE_LOOP_PATCH in line
