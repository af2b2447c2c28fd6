"""docs/team-server.md run as written: a throwaway PostgreSQL 15 cluster and the guide's ``mlflow server`` on it.

:class:`PostgresCluster` is ``initdb`` + ``pg_ctl`` in a temporary folder, run as an unprivileged account
(PostgreSQL refuses root: as root the fixture creates the system account ``train_deploy_pg`` once), listening on
127.0.0.1 only, with password (SCRAM) authentication; the superuser ``postgres``'s password is in the guide's
home's ``.pgpass``, where the guide's ``psql -U postgres`` finds it. :class:`Guide` runs the guide's command blocks
(each marked ``<!-- run: NAME -->``) with bash, with the test's values of the guide's settings. The ``team``
fixture (one per module) sets up the databases, the server and the accounts through the guide, and stops the
server and the cluster, and removes them, afterwards.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.team import guide_blocks
from tests.mlflow_server import HOST, MlflowServer, free_port

# Debian's and Ubuntu's server packages (postgresql-NN); the newest installed.
PG_BIN = max(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]),
             default=Path("/none/initdb")).parent
PG_ACCOUNT = "train_deploy_pg"
def _account() -> tuple[int, int]:
    """The uid and gid PostgreSQL runs as: this process's own, or (as root) the system account, created once."""
    if os.geteuid() != 0:
        return os.getuid(), os.getgid()
    try:
        entry = pwd.getpwnam(PG_ACCOUNT)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_ACCOUNT],
                       check=True, capture_output=True, timeout=60)
        entry = pwd.getpwnam(PG_ACCOUNT)
    return entry.pw_uid, entry.pw_gid


class PostgresCluster:
    """A PostgreSQL cluster of its own in ``root`` (a folder the cluster's account owns) on 127.0.0.1:``port``."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.password = secrets.token_urlsafe(18)
        self.uid, self.gid = _account()
        os.chown(root, self.uid, self.gid)
        root.chmod(0o700)

    @property
    def data(self) -> Path:
        return self.root / "data"

    def _run(self, *command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(PG_BIN / command[0]), *command[1:]], user=self.uid, group=self.gid,
                              extra_groups=[], cwd=self.root, capture_output=True, text=True, timeout=timeout,
                              env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}, check=False)
        assert done.returncode == 0, f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        return done

    def create(self) -> None:
        secret = self.root / "superuser_password"
        secret.write_text(self.password + "\n")
        os.chown(secret, self.uid, self.gid)
        secret.chmod(0o600)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=scram-sha-256", f"--pwfile={secret}",
                  "-E", "UTF8", "--locale=C.UTF-8")
        secret.unlink()
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(f"listen_addresses = '{HOST}'\nport = {self.port}\n"
                       f"unix_socket_directories = '{self.root}'\nfsync = off\n")

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "postgres.log"), "-w", "-t", "60", "start")

    def restart(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "postgres.log"), "-w", "-t", "60",
                  "-m", "fast", "restart")

    def stop(self) -> None:
        """Stop the postmaster and every backend (fast shutdown); a no-op when it is not running."""
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-m", "fast", "stop")

    def remove(self) -> None:
        """Stop the cluster, killing the postmaster's process group if a clean stop failed, and delete it."""
        pid_file = self.data / "postmaster.pid"
        try:
            self.stop()
        except AssertionError:
            if pid_file.exists():
                os.killpg(int(pid_file.read_text().split()[0]), 9)  # the postmaster leads its backends' group
            raise
        finally:
            time.sleep(0.1)
            shutil.rmtree(self.root, ignore_errors=True)


class GuideServer(MlflowServer):
    """The guide's ``server`` block as an :class:`MlflowServer` (one process group, /health, stop/start)."""

    def __init__(self, guide: Guide) -> None:
        super().__init__(guide.root / "server", int(guide.settings["TEAM_PORT"]))
        self.guide = guide

    def command(self) -> list[str]:
        return ["bash", "-euo", "pipefail", "-c", guide_blocks()["server"]]

    def environment(self) -> dict[str, str]:
        return self.guide.environment()


@dataclass
class Guide:
    """The guide's settings for this test, and its blocks run with them (HOME is the test's, for ``~/.pgpass``)."""

    root: Path
    settings: dict[str, str]

    def environment(self, **more: str) -> dict[str, str]:
        keep = {name: os.environ[name] for name in ("LANG", "LC_ALL", "TMPDIR", "PYTHONPATH") if name in os.environ}
        path = f"{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin"
        return {**keep, "PATH": path, "HOME": str(self.root / "home"), "MLFLOW_DISABLE_TELEMETRY": "true",
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "PYTHONUNBUFFERED": "1", **self.settings, **more}

    def run(self, name: str, cwd: Path | None = None, timeout: float = 300,
            **more: str) -> subprocess.CompletedProcess[str]:
        """Run block ``name`` with bash -euo pipefail; fail with its output if it fails."""
        done = self.attempt(name, cwd, timeout, **more)
        assert done.returncode == 0, f"guide block {name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n" \
                                     f"{done.stderr[-5000:]}"
        return done

    def attempt(self, name: str, cwd: Path | None = None, timeout: float = 300,
                **more: str) -> subprocess.CompletedProcess[str]:
        """Block ``name``'s outcome, whatever it is."""
        return subprocess.run(["bash", "-euo", "pipefail", "-c", guide_blocks()[name]], cwd=cwd or self.root,
                              env=self.environment(**more), capture_output=True, text=True, timeout=timeout,
                              check=False)

    def password(self, account: str) -> str:
        """An account's password: the admin's from the auth configuration, the others' from the accounts file."""
        etc = Path(self.settings["MLFLOW_ETC"])
        if account == "admin":
            found = re.search(r"^admin_password = (\S+)$", (etc / "basic_auth.ini").read_text(), re.M)
        else:
            found = re.search(rf"^{account} (\S+)$", (etc / "new_accounts").read_text(), re.M)
        assert found, f"no password for {account}"
        return found.group(1)

    def credentials(self, account: str) -> dict[str, str]:
        return {"MLFLOW_TRACKING_USERNAME": account, "MLFLOW_TRACKING_PASSWORD": self.password(account)}


@dataclass
class Team:
    """The module's team setup: the cluster, the guide, and the guide's server (``server.uri``)."""

    cluster: PostgresCluster
    guide: Guide
    server: GuideServer


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    """The guide's databases, server and accounts on a fresh cluster; everything stopped and removed after."""
    if not (PG_BIN / "initdb").exists() or not shutil.which("psql"):
        pytest.skip("PostgreSQL server and client are not installed (Debian: apt-get install postgresql)")
    cluster = PostgresCluster(Path(tempfile.mkdtemp(prefix="train_deploy_pg_")), free_port())
    root = tmp_path_factory.mktemp("team")
    (root / "home").mkdir()
    port = free_port()
    settings = {"PGHOST": HOST, "PGPORT": str(cluster.port), "TEAM_HOST": HOST, "TEAM_PORT": str(port),
                "TEAM_URI": f"http://{HOST}:{port}", "MLFLOW_ETC": str(root / "etc"),
                "MLFLOW_ARTIFACTS": str(root / "artifacts"), "BACKUPS": str(root / "backups")}
    guide = Guide(root, settings)
    server = GuideServer(guide)
    try:
        cluster.create()
        cluster.start()
        pgpass = root / "home" / ".pgpass"
        pgpass.write_text(f"{HOST}:{cluster.port}:*:postgres:{cluster.password}\n")
        pgpass.chmod(0o600)
        guide.run("databases")
        guide.run("auth-config")
        server.start(timeout=120)
        guide.run("accounts")
        yield Team(cluster, guide, server)
    finally:
        try:
            server.stop()
        finally:
            cluster.remove()
