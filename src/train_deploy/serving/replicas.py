"""``train-deploy serve --replicas N``: the same server app as N Ray Serve replicas behind Ray Serve's HTTP proxy.

``python -m train_deploy.serving.replicas`` (as :func:`train_deploy.serve.serve` starts it, with the environment it
gives uvicorn otherwise) joins the Ray cluster at ``TRAIN_DEPLOY_RAY_ADDRESS`` or starts a private local instance
(its temporary folder removed at the end), starts Ray Serve's proxy on ``TRAIN_DEPLOY_SERVE_HOST:PORT`` and deploys
one deployment whose replicas each build the app ``serving/app.py`` builds (or ``serving/follow.py``'s with
``--follow``) from the downloaded model: every replica loads the model, enforces the same limits and queues, and
answers every route (``/invocations``, ``/v1/completions`` streamed, ``/metrics`` of the replica that answers, the
playground). ``TRAIN_DEPLOY_SERVE_MAX_REPLICAS`` above ``TRAIN_DEPLOY_SERVE_REPLICAS`` makes Ray Serve scale between
the two by the requests waiting per replica, adding a replica once they stayed above the target for
``TRAIN_DEPLOY_SERVE_SCALE_UP_S`` seconds and removing one once they stayed below for
``TRAIN_DEPLOY_SERVE_SCALE_DOWN_S`` (unset: Ray Serve's ``upscale_delay_s`` and ``downscale_delay_s``). Each answer
names its replica in ``x-replica``. SIGTERM or Ctrl-C removes the deployment and stops the private instance.

The model's folder must be readable on every node a replica runs on: on a single machine it is the per-version
cache of ``train-deploy serve``; on a cluster, see docs/serving.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
from typing import Any

logger = logging.getLogger(__name__)

REPLICAS, MAX_REPLICAS = "TRAIN_DEPLOY_SERVE_REPLICAS", "TRAIN_DEPLOY_SERVE_MAX_REPLICAS"
SCALE_UP_S, SCALE_DOWN_S = "TRAIN_DEPLOY_SERVE_SCALE_UP_S", "TRAIN_DEPLOY_SERVE_SCALE_DOWN_S"
"""Seconds the requests per replica must stay above (below) the target before Ray Serve adds (removes) a replica;
unset, Ray Serve's defaults (``upscale_delay_s`` 30, ``downscale_delay_s`` 600 in Ray 2.60)."""
RAY_ADDRESS, HOST, PORT = "TRAIN_DEPLOY_RAY_ADDRESS", "TRAIN_DEPLOY_SERVE_HOST", "TRAIN_DEPLOY_SERVE_PORT"
PASSED_ON = ("TRAIN_DEPLOY_", "MLFLOW_")
"""The variables each replica gets from this process (the served model, its settings, the store)."""
APPLICATION = "train_deploy"
SHUTDOWN_S = 10.0
"""The longest the end waits for Ray to stop before it removes the private instance's folder."""


def build_app() -> Any:
    """One replica's ASGI app: the following app when ``TRAIN_DEPLOY_FOLLOW_ALIAS`` is set, else the server's,
    each answer naming the replica."""
    if os.environ.get("TRAIN_DEPLOY_FOLLOW_ALIAS"):
        from train_deploy.serving.follow import create_app
    else:
        from train_deploy.serving.app import create_app
    app = create_app()
    replica = str(os.getpid()).encode()  # the replica's process: what a SIGKILL names

    async def named(scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def send_named(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-replica", replica)]}
            await send(message)

        await app(scope, receive, send_named if scope["type"] == "http" else send)

    return named


def deployment_options(environ: dict[str, str]) -> dict[str, Any]:
    """Ray Serve's options for the deployment: the replicas (or autoscaling between the two counts, with the scale
    delays set), what one replica takes at once (the lanes' workers and queues: more would wait at the proxy, not
    get a 429), its environment."""
    from train_deploy.serving.app import ServerSettings

    settings = ServerSettings.from_environment(environ)
    least = int(environ.get(REPLICAS, "1"))
    most = max(least, int(environ.get(MAX_REPLICAS, str(least))))
    options: dict[str, Any] = {
        "max_ongoing_requests": 1 + settings.batch + 2 * settings.queue,
        "ray_actor_options": {"num_cpus": 1, "runtime_env": {"env_vars": {
            name: value for name, value in environ.items() if name.startswith(PASSED_ON)}}}}
    if most > least:
        options["autoscaling_config"] = {"min_replicas": least, "max_replicas": most,
                                         "target_ongoing_requests": max(1, settings.batch // 2)}
        for name, key in ((SCALE_UP_S, "upscale_delay_s"), (SCALE_DOWN_S, "downscale_delay_s")):
            if environ.get(name):
                options["autoscaling_config"][key] = _seconds(environ, name)
    else:
        options["num_replicas"] = least
    return options


def _seconds(environ: dict[str, str], name: str) -> float:
    """``environ[name]`` as a number of seconds of at least 0, or a one-line error naming the variable."""
    try:
        seconds = float(environ[name])
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise ValueError(f"{name}={environ[name]!r}: expected a number of seconds, 0 or more")
    return seconds


def main() -> None:
    """Deploy, then wait for SIGTERM or Ctrl-C; remove the deployment and stop a private Ray instance."""
    import ray
    from ray import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    environ = dict(os.environ)
    options = deployment_options(environ)
    stopping = threading.Event()
    temp_dir = None
    init = {"include_dashboard": False, "configure_logging": False, "log_to_driver": True}
    if environ.get(RAY_ADDRESS):
        ray.init(address=environ[RAY_ADDRESS], **init)
    else:
        temp_dir = tempfile.mkdtemp(prefix="train_deploy-serve-ray-")
        most = options.get("autoscaling_config", {}).get("max_replicas", options.get("num_replicas", 1))
        ray.init(address="local", num_cpus=max(most, os.cpu_count() or 1), _temp_dir=temp_dir, **init)
    for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(signum, lambda *_: stopping.set())
    try:
        serve.start(http_options={"host": environ.get(HOST, "127.0.0.1"), "port": int(environ.get(PORT, "5001"))})
        deployment = serve.deployment(name="server", **options)(serve.ingress(build_app)(type("Server", (), {})))
        serve.run(deployment.bind(), name=APPLICATION, route_prefix="/")
        shown = {key: value for key, value in options.items() if key != "ray_actor_options"}
        logger.info("Serving through Ray Serve's proxy on http://%s:%s with %s", environ.get(HOST, "127.0.0.1"),
                    environ.get(PORT, "5001"), shown)
        stopping.wait()
    finally:
        _stop(temp_dir)


def _stop(temp_dir: str | None) -> None:
    """Remove the deployment from a cluster; a private instance goes whole, with its temporary folder."""
    import ray
    from ray import serve

    try:
        if temp_dir is None:
            serve.shutdown()
    finally:
        # a supervisor's SIGTERM reaches Ray's own processes too (one process group, one cgroup), and ray.shutdown
        # then waits for a GCS that is gone: bounded, and the folder is removed either way
        stopper = threading.Thread(target=ray.shutdown, daemon=True)
        stopper.start()
        stopper.join(SHUTDOWN_S)
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
            logger.info("Stopped the private Ray instance")


if __name__ == "__main__":
    main()
    logging.shutdown()
    os._exit(0)  # Ray's exit handlers would wait for the processes stopped above once more
