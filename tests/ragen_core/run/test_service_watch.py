"""The service watch and its watchdog say the line of a dead service exactly once, whoever ends the
process: the watch itself (the line is out before the command ends), or something faster, as Ray's
driver ends its own process the moment it touches a dead raylet's object store (the watchdog says
it from the last-words file). CI once saw neither: the watch had taken the file back and was about
to write when Ray ended the process, and the run ended with no line at all."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

#: A process with a watchdog and one watched service (a sleeping child), which it then kills.
#: "watch": the watch notices and ends the process; "first": the process ends in the same breath,
#: before the watch thread can run (os.kill and os._exit keep the GIL), as Ray's driver does; "mid":
#: the process ends the moment the last-words file is gone, while the watch is saying its line (where
#: the old watch took the file back before it wrote, this lost the line).
CHILD = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from flows.settings import start_watchdog
    from ragen_core.run.service_watch import LAST_WORDS_VAR, watch_services

    assert start_watchdog()
    service = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch_services({service.pid: "test service"})
    print(service.pid, flush=True)
    time.sleep(0.3)
    os.kill(service.pid, signal.SIGKILL)
    if sys.argv[1] == "first":
        os._exit(1)
    if sys.argv[1] == "mid":
        words = os.environ[LAST_WORDS_VAR.format(pid=os.getpid())]
        while os.path.exists(words):
            pass
        os._exit(1)
    time.sleep(30)
    os._exit(3)  # the watch did not end the process
    """
)


def _play(mode: str, tmp_path: Path) -> tuple[int, str, str]:
    err = tmp_path / f"{mode}.err"
    with err.open("w") as stderr:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, mode],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[3],
        )
    return proc.returncode, proc.stdout.strip(), err.read_text()


@pytest.mark.parametrize("mode", ["watch", "first", "mid"])
def test_the_line_of_a_dead_service_is_said_exactly_once(mode: str, tmp_path: Path) -> None:
    for attempt in range(3):  # the race has more than one outcome; each must say the line once
        code, pid, said_at_exit = _play(mode, tmp_path)
        line = f"the run's test service (pid {pid}) exited mid-run; no run folder was made yet; run the command again"
        if mode != "first":
            # the watch waits for the watchdog: the line is out before the command ends
            assert said_at_exit.splitlines().count(line) == 1, said_at_exit
        deadline = time.monotonic() + 5  # the watchdog of a process that ended first speaks a moment later
        while line not in (tmp_path / f"{mode}.err").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # and says nothing more
        text = (tmp_path / f"{mode}.err").read_text()
        assert code == 1, (attempt, text)
        assert text.splitlines() == [line], (attempt, text)
