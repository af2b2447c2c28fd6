"""The project's configuration as ``kedro run`` loads it (``conf/base`` under ``conf/<env>``), for the commands that
work beside a run without starting one: ``train-deploy serve`` reads the registry's URIs, the scheduler reads
``notify`` to report a slot it skipped."""

from __future__ import annotations

from pathlib import Path


def project_config(project: Path, env: str | None):
    """The project's configuration loader, built from the project's Kedro settings as a run builds it."""
    from kedro.framework.project import configure_project, settings

    configure_project(__package__)
    return settings.CONFIG_LOADER_CLASS(conf_source=str(project / "conf"), env=env, **settings.CONFIG_LOADER_ARGS)
