"""``train-deploy-registry``: the promotion history of a registered model, and rolling ``champion`` back.

    train-deploy-registry history  [--model train_deploy_lm] [--tracking-uri URI]
    train-deploy-registry rollback [--model train_deploy_lm] [--tracking-uri URI]

The tracking server is ``--tracking-uri``, else ``MLFLOW_TRACKING_URI`` (credentials, as for MLflow, only from
``MLFLOW_TRACKING_USERNAME``/``PASSWORD``/``TOKEN``). Output goes to stdout; an error is one line on stderr and
exit status 1. ``rollback`` takes the model's registry lock (``train_deploy.registry.aliases``): it waits for a
gate that is moving the aliases, and completes a move an interrupted run recorded before it rolls back.
"""

from __future__ import annotations

import argparse
import os
import sys

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from train_deploy.redaction import redact_uri
from train_deploy.registry.aliases import AliasMoveError, RollbackError, rollback
from train_deploy.registry.config import RegistryConfig
from train_deploy.registry.history import format_table, read_history
from train_deploy.registry.retry import RegistryRefused, RegistryUnreachable, Retrying


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status."""
    args = _parser().parse_args(argv)
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        sys.stderr.write("train-deploy-registry: no tracking server; pass --tracking-uri or set "
                         "MLFLOW_TRACKING_URI\n")
        return 1
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        if args.command == "history":
            events = read_history(client, args.model)
            sys.stdout.write(format_table(events) if events else f"{args.model}: no history yet\n")
        else:
            event = rollback(client, args.model, Retrying(RegistryConfig().retries, uri))
            sys.stdout.write(f"{args.model}: {event['reason']}\n")
    except (MlflowException, RollbackError, AliasMoveError, RegistryUnreachable, RegistryRefused) as exc:
        message = exc.message if isinstance(exc, MlflowException) else str(exc)
        status = exc.get_http_status_code() if isinstance(exc, MlflowException) else getattr(exc, "status", None)
        if status == 403:  # a team server's account
            needs, account = "READ" if args.command == "history" else "EDIT", os.environ.get("MLFLOW_TRACKING_USERNAME")
            message = f"permission denied (HTTP 403) for {account!r}: needs {needs} on registered model {args.model}"
        first = message.strip().splitlines()[0] if message.strip() else repr(exc)
        sys.stderr.write(f"train-deploy-registry {args.command}: {redact_uri(uri)}: {redact_uri(first)}\n")
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train-deploy-registry", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("history", "print every promotion decision and rollback of the model, oldest first"),
                       ("rollback", "champion <- previous, previous <- the old champion; recorded in the history")):
        command = commands.add_parser(name, help=text, description=text)
        command.add_argument("--model", default=RegistryConfig().model_name,
                             help="registered model name (default: %(default)s)")
        command.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
