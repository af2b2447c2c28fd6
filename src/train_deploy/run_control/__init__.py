"""Run control: what happens around the stages of a run, one module each.

- :mod:`~train_deploy.run_control.lock`: one run at a time per project (an OS lock on its data folder);
- :mod:`~train_deploy.run_control.signals`: SIGTERM ends a run as its hooks say; a run killed outright says so;
- :mod:`~train_deploy.run_control.notify`: alerts, one JSON message per run outcome;
- :mod:`~train_deploy.run_control.processes`: stopping a process tree, the one helper for it;
- :mod:`~train_deploy.run_control.preflight`: the run's configuration checked before any node runs;
- :mod:`~train_deploy.run_control.retrain`: the skip decision (nothing changed since the champion);
- :mod:`~train_deploy.run_control.schedule`: ``train-deploy schedule``, runs on a cron schedule.

:class:`train_deploy.hooks.life.RunLife` puts them together into a run's life. The first four stand on the ground
floor, as the domains use them (the registry's alias lock, the corpus executors' helpers); the last three stand
above the domains (tests/test_code_shape.py). This file imports nothing, so that importing the lock does not
import the skip decision.
"""
