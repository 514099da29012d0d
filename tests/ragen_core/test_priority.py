"""The helper processes' CPU priority: the increment read from its variable, and a one-way change."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ragen_core.priority import DEFAULT_NICE, lower_priority, nice_increment

VAR = "RAGEN_TEST_NICE"


@pytest.mark.parametrize(("raw", "expected"), [(None, DEFAULT_NICE), ("0", 0), ("19", 19), (" 5", 5)])
def test_the_increment_comes_from_the_variable(
    monkeypatch: pytest.MonkeyPatch, raw: str | None, expected: int
) -> None:
    if raw is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, raw)
    assert nice_increment(VAR) == expected


@pytest.mark.parametrize("raw", ["ten", "-1", "20", ""])
def test_a_bad_increment_is_named_with_its_range(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(VAR, raw)
    with pytest.raises(ValueError, match=f"{VAR}={raw!r} is not a number from 0 to 19"):
        nice_increment(VAR)


def test_a_priority_is_only_ever_lowered() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert not lower_priority(child.pid, 0), "0 changes nothing"
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == mine
        assert lower_priority(child.pid, 4)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == min(mine + 4, 19)
        assert lower_priority(child.pid, 2), "a smaller increment later leaves it where it is"
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == min(mine + 4, 19)
    finally:
        child.kill()
        child.wait()
    assert not lower_priority(child.pid, 4), "a process that is gone"
