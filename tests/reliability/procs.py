"""What a process tree leaves running and which sockets it listens on, read from /proc (Linux).

A tree is found by an environment marker, not by parent links: Ray and Prefect children are
re-parented to init when their parent dies and some start sessions of their own, but every one of
them inherits the environment of the process that started it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MARKER = "RAGEN_TEST_TREE"


def new_marker() -> dict[str, str]:
    """An environment entry that tags every process started under it."""
    return {MARKER: uuid.uuid4().hex}


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours
        return b""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def tree(marker: dict[str, str]) -> dict[int, str]:
    """Live (non-zombie) processes carrying ``marker`` in their environment: pid -> command line."""
    ((key, value),) = marker.items()
    needle = f"{key}={value}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            pid = int(entry.name)
            if pid != os.getpid() and needle in _environ(pid).split(b"\0") and not _is_zombie(pid):
                found[pid] = _cmdline(pid)
    return found


def wait_gone(marker: dict[str, str], timeout: float) -> dict[int, str]:
    """Poll until no process carries ``marker`` or ``timeout`` passes; returns what is left."""
    deadline = time.monotonic() + timeout
    left = tree(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = tree(marker)
    return left


def assert_gone(marker: dict[str, str], timeout: float) -> None:
    """Fail naming every process still carrying ``marker`` after ``timeout``."""
    left = wait_gone(marker, timeout)
    assert not left, "left behind: " + "; ".join(f"{pid} {cmd[:150]}" for pid, cmd in left.items())


def kill_tree(marker: dict[str, str]) -> None:
    """SIGKILL whatever carries ``marker`` (a test's clean-up, so a failure leaks nothing)."""
    for pid in tree(marker):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, 9)


@dataclass(frozen=True)
class Listener:
    pid: int
    cmdline: str
    proto: str  # tcp, tcp6, udp, udp6
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback

    def __str__(self) -> str:
        return f"{self.proto} {self.address}:{self.port} pid {self.pid} ({self.cmdline[:120]})"


def _decode(hex_address: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_address)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc prints an IPv6 address as four host-order 32-bit words
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped or address)


def _socket_table(pid: int) -> dict[int, tuple[str, str, int]]:
    """Listening TCP and bound UDP sockets of the network namespace ``pid`` is in: inode -> (proto, ip, port)."""
    table = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            # TCP: 0A is LISTEN. UDP has no listen state: any bound socket receives (07 = unconnected).
            if (proto.startswith("tcp") and state != "0A") or (proto.startswith("udp") and state != "07"):
                continue
            hex_ip, hex_port = local.split(":")
            table[inode] = (proto, _decode(hex_ip, proto.endswith("6")), int(hex_port, 16))
    return table


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def listeners(pids: dict[int, str]) -> list[Listener]:
    """Listening TCP / bound UDP sockets held by ``pids`` (pid -> command line)."""
    found = []
    tables: dict[str, dict[int, tuple[str, str, int]]] = {}
    for pid, cmdline in pids.items():
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if namespace not in tables:
            tables[namespace] = _socket_table(pid)
        for inode in _socket_inodes(pid):
            if inode in tables[namespace]:
                proto, address, port = tables[namespace][inode]
                found.append(Listener(pid, cmdline, proto, address, port))
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    args: list[str],
    state: Path,
    marker: dict[str, str],
    extra_env: dict[str, str] | None = None,
    log_name: str = "cli",
) -> tuple[object, Path, Path]:
    """Start ``python -m flows.cli ARGS`` in its own session, tagged with ``marker``; nothing is killed
    afterwards (unlike tests.flows.test_train.ragen, whose clean-up would hide what a run leaves).

    Returns the Popen and the paths of its stdout and stderr files."""
    import subprocess
    import sys

    from tests.flows.test_train import PREFECT_HOME, ROOT
    from tests.process_env import child_env

    env = child_env(
        RAGEN_STATE_DIR=str(state), PYTHONUNBUFFERED="1", PREFECT_HOME=str(PREFECT_HOME), **marker
    )
    env.update(extra_env or {})
    state.mkdir(parents=True, exist_ok=True)
    out_path, err_path = state / f"{log_name}.out", state / f"{log_name}.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    return proc, out_path, err_path


def resume_to_the_end(run_name: str, state: Path, marker: dict[str, str]) -> None:
    """``ragen train --resume RUN`` to completion (rc 0), its processes killed afterwards."""
    resumed, out, err = launch(["train", "--resume", run_name], state, marker, log_name="resume")
    try:
        assert resumed.wait(timeout=600) == 0, out.read_text()[-2000:] + err.read_text()[-3000:]  # type: ignore[attr-defined]
    finally:
        kill_tree(marker)


def tiny_train_args(state: Path, *extra: str) -> list[str]:
    """``train`` arguments of the seconds-long bandit-tiny run of tests.flows.test_train (+ ``extra`` overrides)."""
    from tests.flows.test_train import CONFIG, TINY

    sets = [x for o in [*TINY, *extra, f"trainer.run_root={state / 'runs'}"] for x in ("--set", o)]
    return ["train", str(CONFIG), *sets]


@contextlib.contextmanager
def ray_current_cluster_kept() -> Iterator[None]:
    """Put the machine's current-Ray-cluster entry back as it was afterwards: `ray start` registers
    its cluster there, killing it leaves the entry behind, and any other ray.init() on the machine
    would then try to join the dead cluster."""
    from ray._common.utils import get_ray_address_file

    registry = Path(get_ray_address_file(None))
    before = registry.read_text() if registry.is_file() else None
    try:
        yield
    finally:
        if before is None:
            registry.unlink(missing_ok=True)
        else:
            registry.write_text(before)
