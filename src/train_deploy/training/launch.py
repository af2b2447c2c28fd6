"""Start the training workers with Paddle's own launcher, stream their progress, and wait.

:func:`run_training` writes the run's :class:`~train_deploy.training.spec.RunSpec` as ``<logs>/run.json`` and
runs::

    python -m paddle.distributed.launch --nproc_per_node G [--nnodes N --master HOST:PORT --rank R]
        --log_dir <logs>/node<R> --max_restart K .../worker.py --run <logs>/run.json

The other machines of a multi-node job join with ``train-deploy-join --run <logs>/run.json --node-rank R``
(the log folder on storage every node sees): the same launcher command with their own rank.

With ``launch.elastic`` (``train_deploy.training.elastic``) every node's launcher gets ``--master etcd://…
--nnodes MIN:MAX --elastic_level 1`` instead of a count and a rank: Paddle's launcher re-forms the job when a node
is lost or joins, and :func:`check_elastic` refuses in one line, before launch, a job that could not.

Safe to leave unattended:

- the launcher runs in a session of its own (Paddle gives each worker one too), and the whole job is stopped,
  SIGTERM then SIGKILL after ``STOP_GRACE_S``, when this process gets SIGTERM or SIGINT (Ctrl-C), when
  :func:`run_launcher` returns or raises, and when rank 0 reports no step for ``launch.stall_timeout``
  seconds; on Linux the kernel also sends the launcher SIGTERM when this process dies, even by SIGKILL;
- the launcher writes every environment variable it gets into its log folder (``envlog.<rank>``,
  ``backup_env.<rank>.json``), so it gets only the variables Python, Paddle and the CPU/GPU libraries read
  (:data:`WORKER_VARIABLES`) and those ``launch.environment`` lists, never one holding a credential
  (:data:`SECRET_VARIABLES`), and the log folders are readable by their owner only (mode 0700);
- the workers do not talk to MLflow: rank 0 writes ``metrics.jsonl``, and this process sends its lines to the
  Kedro run's MLflow run (:class:`~train_deploy.training.metrics.MetricsForwarder`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, NoReturn

import click
import psutil

from train_deploy.config import ConfigError
from train_deploy.environment import first_cpu, mkl_cpu_type
from train_deploy.handoffs import DescriptionError, TrainingResult, read_json, write_json
from train_deploy.redaction import redact_uri
from train_deploy.run_control.processes import stop_process_tree
from train_deploy.training import elastic, layout, worker
from train_deploy.training.config import TrainingConfig, resolve_layout
from train_deploy.training.metrics import MetricsForwarder
from train_deploy.training.spec import RunSpec

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
POLL_S = 0.5
"""How often the node looks at the launcher, rank 0's log and the signals it got."""
STOP_GRACE_S = 10.0
"""Seconds the job's processes get to exit after SIGTERM before SIGKILL."""

# The environment variables the launcher (and so every worker) gets, as shell patterns over the name: it writes
# all it gets into its log folder, so an allow-list of what the workers' software reads, not a list of what to
# hide (a credential under a name nobody thought of stays out). ``launch.environment`` adds the user's own.
WORKER_VARIABLES = (
    # the system, the C library and Python
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TMPDIR", "TEMP", "TMP",
    "TERM", "LD_LIBRARY_PATH", "LD_PRELOAD", "XDG_CACHE_HOME", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME",
    "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "PYTHONFAULTHANDLER",
    "PYTHONIOENCODING", "PYTHONUTF8",
    # Paddle, its launcher and collective back-ends
    "FLAGS_*", "PADDLE_*", "GLOG_*", "POD_*", "GLOO_*", "NCCL_*", "MASTER_ADDR", "MASTER_PORT",
    # CPU math libraries (OpenMP, MKL, OpenBLAS, oneDNN)
    "OMP_*", "KMP_*", "GOMP_*", "MKL_*", "OPENBLAS_*", "DNNL_*", "ONEDNN_*",
    # GPUs
    "CUDA_*", "NVIDIA_*", "CUDNN_*", "CUBLAS_*", "CUBLASLT_*", "TF_ENABLE_*", "TENSORRT_*",
    # PaddleNLP's model folder
    "PPNLP_HOME", "PADDLENLP_*",
)

# Never passed, allowed or listed: shell patterns over the upper-cased name; a variable whose value holds a URI
# with user information (scheme://user:password@host) is left out too. The workers need no credentials: this
# process talks to MLflow.
SECRET_VARIABLES = (
    "*PASSWORD*", "*PASSWD*", "*TOKEN*", "*SECRET*", "*_KEY", "*CREDENTIALS*", "*CONNECTION_STRING*",
    "AWS_ACCESS_KEY_ID", "MLFLOW_TRACKING_USERNAME",
)


class TrainingFailed(RuntimeError):
    """A worker died, raised or stalled; the message names the rank and ends with the tail of its log."""


class TrainingStopped(RuntimeError):
    """This process was asked to stop (SIGTERM, SIGINT) while training; the whole job was stopped."""


def run_training(spec: RunSpec, mlflow_run_id: str | None = None) -> TrainingResult:
    """Run (or resume) the job ``spec`` describes on this node's workers; return rank 0's result.

    Writes ``<spec.logs>/run.json`` for the workers (and the nodes that join), relaunches failed workers
    up to ``launch.max_restart`` times, and raises :class:`TrainingFailed` when they still fail, or
    :class:`TrainingStopped` when stopped by a signal. Sends rank 0's metrics to the MLflow run
    ``mlflow_run_id`` (through this process's tracking URI) while the job runs.
    """
    if spec.training.layout == "auto":
        spec = plan_layout(spec)
    config = spec.training
    logs = _private_folder(Path(spec.logs))
    spec_file = logs / RUN_FILE
    if config.launch.elastic is not None:
        check_elastic(spec)
    write_json(spec_file, spec)
    forwarding = (MetricsForwarder(spec.metrics_path, mlflow_run_id, final_timeout=config.launch.metrics_timeout)
                  if mlflow_run_id else contextlib.nullcontext())
    with forwarding:
        run_launcher(config, spec_file, logs)
    return read_json(TrainingResult, spec.result_path)


def plan_layout(spec: RunSpec) -> RunSpec:
    """``training.layout: auto``: ``spec`` with the degrees, micro-batch and recomputation
    :func:`~train_deploy.training.layout.choose_layout` picks for this job's devices, logged in one line. ``dp``
    stays inferred, so that an elastic job re-forms at any world size; the plan is for its largest."""
    config, la = spec.training, spec.training.launch
    nodes = la.elastic.max_nodes if la.elastic is not None else la.nnodes
    devices = layout.Devices(kind=config.device.type, world=la.nproc_per_node * nodes, per_node=la.nproc_per_node,
                             memory_bytes=device_memory(config))
    shape = config.model.shape()
    vocab = shape.get("vocab_size", spec.data.vocab_size)
    work = layout.Workload(shape=shape, vocab_size=vocab, global_batch_size=config.batch.global_batch_size,
                           seq_length=config.batch.seq_length, low_precision=config.precision.amp)
    choice = layout.choose_layout(work, devices)
    logger.info("%s", layout.describe(choice, devices))
    parallel = dataclasses.replace(config.parallel, dp=-1, mp=choice.mp, sharding_stage=choice.sharding_stage)
    training = dataclasses.replace(
        config, parallel=parallel, layout="manual",  # planned once: the workers and a resume read these degrees
        batch=dataclasses.replace(config.batch, micro_batch_size=choice.micro_batch_size),
        precision=dataclasses.replace(config.precision, recompute=choice.recompute))
    return dataclasses.replace(spec, training=training, layout=resolve_layout(training, training.world_size, vocab))


def device_memory(config: TrainingConfig) -> int:
    """Bytes one worker may use: its GPU's memory (``nvidia-smi``, not Paddle: importing it here would install its
    signal handlers in the training node), or the node's available memory shared by its CPU workers."""
    if config.device.type == "gpu":
        found = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, check=True).stdout.split()
        return int(found[0]) * 2**20
    return psutil.virtual_memory().available // config.launch.nproc_per_node


def check_elastic(spec: RunSpec) -> None:
    """Refuse in one line, before anything starts, an elastic job that could not go on at every world size it
    may re-form at (:func:`~train_deploy.training.elastic.check_layout`, and the layout at each size), or whose
    etcd cannot be reached."""
    config = spec.training
    la, p = config.launch, config.parallel
    elastic.check_layout(la.elastic, pp=p.pp, mp=p.mp, dp=p.dp, nproc_per_node=la.nproc_per_node, nnodes=la.nnodes)
    vocab = config.model.shape().get("vocab_size", spec.data.vocab_size)
    for world in elastic.world_sizes(la.elastic, la.nproc_per_node):
        try:
            resolve_layout(config, world, vocab)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (training.launch.elastic: at world size {world}, which the job may re-form "
                              "at)") from None
    elastic.check_reachable(la.elastic.etcd)


def launcher_command(config: TrainingConfig, spec_file: Path, log_dir: Path, node_rank: int | None = None) -> list[str]:
    """Paddle's launcher for this node; its logs go to ``<log_dir>/node<rank>``."""
    la = config.launch
    rank = la.node_rank if node_rank is None else node_rank
    command = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(la.nproc_per_node),
               "--log_dir", str(Path(log_dir) / f"node{rank}"), "--job_id", la.job_id,
               "--max_restart", str(la.max_restart)]
    if la.elastic is not None:  # etcd forms the job from the nodes alive: no fixed count, no rank
        command += elastic.launcher_arguments(la.elastic)
    elif la.nnodes > 1:
        command += ["--nnodes", str(la.nnodes), "--master", str(la.master), "--rank", str(rank)]
    if config.device.type == "cpu":
        command += cpu_job_devices(la.nproc_per_node)
    # elastic: the worker runs under elastic.py, which holds a failed worker until etcd tells of a lost node
    script = [elastic.__file__, worker.__file__] if la.elastic is not None else [worker.__file__]
    return command + script + ["--run", str(spec_file)]


def cpu_job_devices(nproc: int) -> list[str]:
    """Launcher arguments for a ``device: cpu`` job: none with the CPU wheel; with the GPU wheel on a machine
    with GPUs, every rank is handed the first visible GPU (which it never uses: the worker sets the CPU device and
    gloo), because the launcher gives each rank its own GPU and fails when there are fewer GPUs than ranks."""
    from importlib import metadata

    try:
        metadata.distribution("paddlepaddle-gpu")
    except metadata.PackageNotFoundError:
        return []
    labels = visible_gpus()
    return ["--devices", ",".join([labels[0]] * nproc)] if labels else []


_DETECT = ("from paddle.distributed.launch.context.device import Device, DeviceType\n"
           "d = Device.parse_device()\nprint(','.join(d.labels) if d.dtype == DeviceType.GPU else '')")


def visible_gpus() -> list[str]:
    """The GPU labels Paddle's launcher will see, read by its own code in a child process: importing Paddle here
    would install its signal handlers in the training node, over the node's own (a stop must stop the job)."""
    found = subprocess.run([sys.executable, "-c", _DETECT], capture_output=True, text=True, check=True,
                           env={**os.environ, "GLOG_minloglevel": "2"}).stdout.strip().splitlines()
    return [label for label in (found[-1] if found else "").split(",") if label]


def worker_environment(config: TrainingConfig) -> dict[str, str]:
    """The variables of this process's environment that the workers' software reads (:data:`WORKER_VARIABLES`)
    or ``launch.environment`` lists, without credentials (:data:`SECRET_VARIABLES`), with CPU thread counts."""
    allowed = (*WORKER_VARIABLES, *config.launch.environment)
    env = {name: value for name, value in os.environ.items()
           if any(fnmatch.fnmatchcase(name, pattern) for pattern in allowed) and not is_secret(name, value)}
    if config.device.type == "cpu":
        env["PADDLE_DISTRI_BACKEND"] = "gloo"  # the GPU wheel's default is NCCL, which cannot reduce CPU tensors
        # One BLAS/OpenMP pool per worker: launch.cpu_threads, or its share of the cores, unless the user chose.
        share = config.launch.cpu_threads or max(1, (os.cpu_count() or 1) // config.launch.nproc_per_node)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env.setdefault(var, str(share))
        cpu_type = mkl_cpu_type(first_cpu())  # MKL's AVX2 kernels on AMD: ~2x the matmul rate here
        if cpu_type is not None:
            env.setdefault("MKL_DEBUG_CPU_TYPE", cpu_type)
    if config.launch.elastic is not None:
        env.update(elastic.LAUNCHER_ENVIRONMENT)
    env.setdefault("GLOG_minloglevel", "2")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def is_secret(name: str, value: str) -> bool:
    """Whether the variable ``name`` holds a credential: its name matches :data:`SECRET_VARIABLES`
    (case-insensitively) or its value holds a URI with user information."""
    return any(fnmatch.fnmatchcase(name.upper(), pattern) for pattern in SECRET_VARIABLES) or \
        redact_uri(value) != value


def _private_folder(path: Path) -> Path:
    """``path``, created if needed, readable by its owner only: the launcher's logs hold the environment."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
    return path


def run_launcher(config: TrainingConfig, spec_file: Path, log_dir: Path, node_rank: int | None = None) -> None:
    """Run the launcher for this node, echoing rank 0's progress; raise :class:`TrainingFailed` on failure
    and :class:`TrainingStopped` on SIGTERM or SIGINT, in either case after stopping the whole job.

    Paddle's launcher honours ``--max_restart`` only in elastic mode (an etcd master); otherwise this
    function relaunches failed workers up to ``launch.max_restart`` times, and they resume from the
    last complete checkpoint on their own (``resume: auto``).
    """
    # In elastic mode Paddle's launcher re-forms the job itself, up to max_restart times.
    restarts = 0 if config.launch.elastic is not None else config.launch.max_restart
    with _StopSignals() as stop:
        for attempt in range(restarts + 1):
            try:
                _launch_once(config, spec_file, log_dir, node_rank, stop)
                stop.check()
                return
            except TrainingFailed as exc:
                stop.check()  # a job that failed because it was being stopped was stopped
                if attempt == restarts:
                    raise
                logger.warning("%s; restarting the workers (%d of %d), they resume from the last checkpoint",
                               exc, attempt + 1, restarts)


def _launch_once(config: TrainingConfig, spec_file: Path, log_dir: Path, node_rank: int | None,
                 stop: _StopSignals) -> None:
    command = launcher_command(config, spec_file, log_dir, node_rank)
    node_logs = Path(command[command.index("--log_dir") + 1])
    if node_logs.exists():  # keep an earlier attempt's logs beside, not mixed with, this one's
        previous = node_logs.with_name(f"{node_logs.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(node_logs, previous)
    _private_folder(Path(log_dir))
    _private_folder(node_logs)
    logger.info("Launching: %s", " ".join(command))
    la = config.launch
    first_rank = (la.node_rank if node_rank is None else node_rank) * la.nproc_per_node
    with open(node_logs / "launcher.log", "w", encoding="utf-8") as launcher_log:
        job = _Job(command, worker_environment(config), launcher_log)
        progress = _LogFollower(node_logs / "workerlog.0", total=config.schedule.max_steps,
                                stall_timeout=la.stall_timeout)
        try:
            while job.launcher.poll() is None:
                time.sleep(POLL_S)
                job.track()
                progress.echo()
                stop.check()
                if progress.stalled():
                    raise TrainingFailed(progress.stall_message(first_rank))
            progress.echo()
        finally:
            job.stop()
            progress.close()
    if job.launcher.returncode != 0:
        raise TrainingFailed(_failure_message(node_logs, job.launcher.returncode))


class _StopSignals:
    """While a job runs, SIGTERM and SIGINT ask it to stop rather than end this process on the spot.

    The handlers only note the signal (the launch loop stops the job and raises :class:`TrainingStopped`),
    are installed only from the main thread (Python's rule) and put the previous ones back on exit.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _note(self, signum: int, frame: object) -> None:
        self.received = self.received or signal.Signals(signum)

    def check(self) -> None:
        """Raise :class:`TrainingStopped` if a stop signal came."""
        if self.received is not None:
            raise TrainingStopped(f"training stopped by {self.received.name}: the launcher and its workers were "
                                  "stopped; the last complete checkpoint is kept and a rerun resumes from it")


# Run in the launcher's process before it becomes the launcher (exec): the kernel sends it SIGTERM when
# the thread that started it ends, even by SIGKILL, and the launcher then stops its workers. Done here rather
# than in a preexec_fn, which runs between fork and exec where another thread's locks may be held.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "  # 1 = PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or sys.exit('training node gone before the launcher started'); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


class _Job:
    """The launcher, started in a session of its own, and every process it starts, so that all can be stopped."""

    def __init__(self, command: list[str], env: dict[str, str], log: IO[str]) -> None:
        if sys.platform.startswith("linux"):
            command = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]
        self.launcher = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         text=True, env=env, start_new_session=True)
        self.processes: dict[int, psutil.Process] = {}
        self.track()

    def track(self) -> None:
        """Remember the launcher's descendants: Paddle puts each worker in a session of its own, beyond the
        reach of a signal to the launcher's group, and a worker outlives a launcher that is killed."""
        with contextlib.suppress(psutil.Error):
            launcher = psutil.Process(self.launcher.pid)
            for process in (launcher, *launcher.children(recursive=True)):
                self.processes.setdefault(process.pid, process)

    def stop(self) -> None:
        """SIGTERM to every process of the job still alive, SIGKILL to those left after ``STOP_GRACE_S``
        (:func:`~train_deploy.run_control.processes.stop_process_tree`, over the launcher and the workers it
        started)."""
        if self.launcher.poll() is None:
            self.track()
        stop_process_tree(self.launcher, STOP_GRACE_S, known=self.processes.values())
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.launcher.wait(timeout=5.0)


class _LogFollower:
    """Echo rank 0's progress lines (steps, evaluations, checkpoints) from its log as they appear, and tell
    when it has reported no progress for too long: a step or checkpoint line, or before its first step any
    line (start-up, joining the other nodes, building the model and resuming are slow and not steps)."""

    _INTERESTING = re.compile(r"step \d+ |step \d+/\d+ |Checkpoint|Resumed|Model:|No validation")
    _STEP = re.compile(r"step (\d+) ")
    FIRST_STEP_FACTOR, FIRST_STEP_MIN_S = 2, 600.0
    """Before its first step, rank 0 may be silent for this many times ``stall_timeout``, at least this long."""

    def __init__(self, path: Path, total: int, stall_timeout: float) -> None:
        from tqdm.auto import tqdm

        self.path, self.offset = path, 0
        self.bar = tqdm(total=total, desc="training", unit="step", dynamic_ncols=True, mininterval=1.0,
                        disable=None)  # no bar (carriage returns) when the console is a file or a pipe
        self.stall_timeout, self.stepped, self.last_progress = stall_timeout, False, time.monotonic()

    def stalled(self) -> bool:
        limit = self.stall_timeout if self.stepped else \
            max(self.FIRST_STEP_FACTOR * self.stall_timeout, self.FIRST_STEP_MIN_S)
        return time.monotonic() - self.last_progress > limit

    def stall_message(self, rank: int) -> str:
        text = self.path.read_text(encoding="utf-8", errors="replace") if self.path.exists() else ""
        waited = "no step" if self.stepped else "no output and no first step"
        return (f"training worker rank {rank} reported {waited} for {time.monotonic() - self.last_progress:.0f} s "
                f"(training.launch.stall_timeout = {self.stall_timeout:g} s), so the job was stopped as hung. "
                f"{self.path}: {_tail(text) or '(empty)'}")

    def close(self) -> None:
        self.bar.close()

    def echo(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(self.offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]
        self.offset += len(complete.encode("utf-8"))
        for line in complete.splitlines():
            interesting = self._INTERESTING.search(line)
            if interesting:
                logger.info("%s", line.split(" - ", 1)[-1].strip())
            if interesting or not self.stepped:
                self.last_progress = time.monotonic()
            if step := self._STEP.search(line):
                self.stepped = True
                if int(step.group(1)) > self.bar.n:
                    self.bar.update(int(step.group(1)) - self.bar.n)


_COMMUNICATION = re.compile(r"gloo|IoException|Connection reset|NCCL|Broken pipe|socket", re.IGNORECASE)
# Paddle's launcher names the first worker that failed: "Container rank 1 status failed cmd [...] code -9 log ...";
# a negative code is the signal that ended it (its peers may be stopped before they notice the lost connection).
_KILLED_CONTAINER = re.compile(r"Container rank (?P<rank>\d+) status failed .*? code (?P<code>-\d+) ")


def _failure_message(log_dir: Path, code: int) -> str:
    """Name the worker that failed first, with the last lines of its log.

    A worker that raised has a traceback that is not about lost connections; a worker that was killed
    (SIGKILL, out of memory) leaves no error at all while its peers report the broken connection; when the
    launcher stopped them before they noticed, its log names the first worker that ended and the signal.
    """
    logs = {int(p.suffix[1:]): p.read_text(encoding="utf-8", errors="replace")
            for p in log_dir.glob("workerlog.*") if p.suffix[1:].isdigit()}
    for rank, text in sorted(logs.items()):
        trace = text[text.find("Traceback"):] if "Traceback" in text else ""
        if trace and not _COMMUNICATION.search(trace):
            return f"training worker rank {rank} failed (launcher exit code {code}): {_tail(text)}"
    silent = [rank for rank, text in sorted(logs.items()) if not _COMMUNICATION.search(text)
              and "Traceback" not in text]
    if silent and len(silent) < len(logs):
        return (f"training worker rank {silent[0]} died without an error (killed, out of memory or crashed; "
                f"launcher exit code {code}); the other ranks lost their connection to it. "
                f"{log_dir / f'workerlog.{silent[0]}'}: {_tail(logs[silent[0]])}")
    launcher = (log_dir / "launcher.log").read_text(encoding="utf-8", errors="replace") \
        if (log_dir / "launcher.log").is_file() else ""
    if (killed := _KILLED_CONTAINER.search(launcher)) and int(killed["rank"]) in logs:
        rank, signal_number = int(killed["rank"]), -int(killed["code"])
        name = signal.Signals(signal_number).name if signal_number in signal.valid_signals() else signal_number
        return (f"training worker rank {rank} died without an error (killed by {name}: out of memory, or a kill; "
                f"launcher exit code {code}); the launcher stopped the other ranks. "
                f"{log_dir / f'workerlog.{rank}'}: {_tail(logs[rank])}")
    return f"training failed (launcher exit code {code}); logs in {log_dir}: {_tail(launcher)}"


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def join_main(argv: list[str] | None = None) -> None:
    """``train-deploy-join``: run this machine's share of a multi-node job started by ``kedro run``; returns when
    it has finished. What cannot join the job is refused in one line, exit status 2, before launching anything."""
    try:
        _join_command.main(args=argv, prog_name="train-deploy-join")
    except SystemExit as ended:  # click exits even after success or --help; a caller in this process gets back
        if ended.code:
            raise


@click.command(name="train-deploy-join", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--run", "run_file", required=True,
              help="run.json of the job (in its log folder, on shared storage)")
@click.option("--node-rank", type=int, required=True, help="this machine's rank, 1 .. nnodes - 1")
def _join_command(run_file: str, node_rank: int) -> None:
    """Run this machine's share of a multi-node training job that node 0's `kedro run` started."""
    where = "node 0's kedro run writes it into its training_logs folder, on storage every node sees"
    if not Path(run_file).is_file():
        _refuse(f"--run {run_file}: no such file; {where}")
    try:
        spec = read_json(RunSpec, Path(run_file))  # the training node validated it: deserialised only
    except DescriptionError as exc:
        _refuse(f"--run {run_file}: not a job's run.json ({exc}); {where}")
    config, key, nnodes = spec.training, "training.launch.nnodes", spec.training.launch.nnodes
    if config.launch.elastic is not None:  # etcd ranks the nodes; R only names this node's log folder
        key, nnodes = "training.launch.elastic.max_nodes", config.launch.elastic.max_nodes
    if not 1 <= node_rank < nnodes:
        others = f"1 .. {nnodes - 1} (node 0 runs kedro run)" if nnodes > 1 else "none: it runs on node 0 alone"
        _refuse(f"--node-rank {node_rank}: the job has {key} = {nnodes}, so the other machines join as {others}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    run_launcher(config, Path(run_file), Path(spec.logs), node_rank=node_rank)


def _refuse(reason: str) -> NoReturn:
    click.echo(f"train-deploy-join: {reason}", err=True)
    sys.exit(2)
