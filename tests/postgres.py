"""A private PostgreSQL server for the team-setup tests: Debian's ``postgresql`` package (``.ci/run``
installs it), a fresh cluster in a temporary folder, on a free loopback port, torn down on exit.

PostgreSQL refuses to run as root, so as root (CI) the cluster belongs to the package's ``postgres``
user and every server command runs through ``runuser``; the folder is made outside pytest's
temporary tree, whose root-only permissions that user cannot cross."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_e2e import HOST, free_port, group, tail

USER = "ragen"  # the cluster's superuser (trust authentication on loopback: a throwaway cluster)
START_TIMEOUT_S = 60


@dataclass(frozen=True)
class Postgres:
    port: int

    def url(self, database: str, driver: str = "") -> str:
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{USER}@{HOST}:{self.port}/{database}"


def bin_dir() -> Path:
    """Where Debian's server binaries are (``/usr/lib/postgresql/<major>/bin``); never skipped."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).resolve().parent
    pytest.fail(
        "PostgreSQL's server is not installed: apt-get install -y postgresql "
        "(Debian's package; .ci/run installs it)"
    )


def as_server_user(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def run(cmd: list[str], what: str) -> None:
    done = subprocess.run(as_server_user(cmd), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{what} failed ({done.returncode}): {done.stdout}{done.stderr}"


@contextmanager
def postgres_server(log: Path, databases: list[str]) -> Iterator[Postgres]:
    """A running server with ``databases`` created, owned by :data:`USER`."""
    bindir = bin_dir()
    folder = Path(tempfile.mkdtemp(prefix="ragen-pg-"))
    data = folder / "data"
    data.mkdir()
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        for p in (folder, data):
            os.chown(p, pw.pw_uid, pw.pw_gid)
    try:
        run(
            [str(bindir / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync"],
            "initdb",
        )
        port = free_port()
        server = [str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(folder)]
        server += ["-c", f"listen_addresses={HOST}", "-c", "max_connections=200", "-c", "fsync=off"]
        with group(as_server_user(server), log) as proc:
            deadline = time.monotonic() + START_TIMEOUT_S
            while subprocess.run(
                [str(bindir / "pg_isready"), "-h", HOST, "-p", str(port)], capture_output=True
            ).returncode:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"postgres did not start on port {port}\n{tail(log)}")
                time.sleep(0.3)
            for db in databases:
                run([str(bindir / "createdb"), "-h", HOST, "-p", str(port), "-U", USER, db], f"createdb {db}")
            yield Postgres(port)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
