"""``python -m loom.workloads.features COMMAND --config /etc/loom/features.json [options]``.

Commands: ``apply`` (idempotent), ``delete --view NAME``, ``materialize [--start T] [--end T]``,
``historical --entities PARQUET --output PARQUET``, ``serve``. Every command but serve prints its result as
one JSON line on stdout (Feast's own progress output goes to stderr), writes it to ``--result`` when given,
and writes ``{"exitCode", "reason", "message" | result}`` to the termination-message file
(``--termination-log``, else $LOOM_TERMINATION_LOG, else /dev/termination-log), which Kubernetes copies
into the pod's status for the operator.

Exit codes (loom.workloads.features.config): 0 ok; 2 invalid config or view (unknown dtype, unset secret
variable); 3 invalid source (unreadable, missing timestamp/key/feature column); 4 view not found;
1 anything else (a store briefly unreachable: worth a retry).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import traceback
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from loom.workloads.features.config import (
    EXIT_FAILED,
    EXIT_INVALID_CONFIG,
    EXIT_OK,
    FeaturesConfig,
    InvalidConfig,
    UnsupportedDtype,
    WorkloadError,
)

# Kubernetes keeps at most 4096 bytes of a termination message.
_TERMINATION_LIMIT = 4000


def _timestamp(text: str) -> datetime:
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="python -m loom.workloads.features", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = root.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", required=True, help="FeaturesConfig JSON (the rendered ConfigMap)")
    common.add_argument("--view", action="append", default=[], help="only this feature view (repeatable)")
    common.add_argument("--result", help="also write the result JSON here")
    common.add_argument("--termination-log", help="termination-message file (default $LOOM_TERMINATION_LOG)")
    commands.add_parser("apply", parents=[common], help="register the views (no-op when unchanged)")
    commands.add_parser("delete", parents=[common], help="remove --view views from the registry")
    materialize = commands.add_parser("materialize", parents=[common], help="load the online store")
    materialize.add_argument("--start", type=_timestamp, help="window start (default: incremental)")
    materialize.add_argument("--end", type=_timestamp, help="window end (default: now)")
    historical = commands.add_parser("historical", parents=[common], help="point-in-time training set")
    historical.add_argument("--entities", required=True, help="entity dataframe parquet (path or s3://)")
    historical.add_argument("--output", required=True, help="training set parquet to write (path or s3://)")
    historical.add_argument("--full-feature-names", action="store_true", help="columns named view__feature")
    historical.add_argument("--s3-endpoint", help="S3 endpoint for s3:// entities/output (default: the source's)")
    commands.add_parser("serve", parents=[common], help="run Feast's feature server")
    return root


def write_termination_message(path: str | None, document: dict[str, Any]) -> None:
    target = path or os.environ.get("LOOM_TERMINATION_LOG", "/dev/termination-log")
    text = json.dumps(document, separators=(",", ":"))
    if len(text) > _TERMINATION_LIMIT:
        # Per-view detail is the first thing to go; the summary (window, rows, outcome) always fits.
        slim = {k: v for k, v in document.items() if k not in ("featureViews", "columns", "features")}
        if "message" in slim:
            slim["message"] = str(slim["message"])[-3000:]
        text = json.dumps(slim, separators=(",", ":"))
    with contextlib.suppress(OSError):
        Path(target).write_text(text)


def import_commands() -> ModuleType:
    """The commands module, imported only when a command runs, so `--help` and config errors need no Feast import
    (seconds on a small node); without torch, which Feast imports at its own import whenever it is installed
    (feast.torch_wrapper, for tensor conversions no command here asks for). The features image has no torch, but a
    process that can see it (the local stack runs this checkout's environment; a shared image) paid 3-4 CPU-seconds
    and about 490 MB of memory for it. A None in sys.modules makes `import torch` fail at once, which Feast handles
    (torch is optional to it)."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    from loom.workloads.features import commands

    return commands


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    commands = import_commands()
    try:
        config = FeaturesConfig.from_file(args.config)
    except (OSError, ValueError) as error:  # unreadable file, bad JSON, or pydantic's ValidationError
        raise InvalidConfig(f"config {args.config}: {error}") from error
    store = commands.open_store(config)
    result: dict[str, Any] | None = None
    if args.command == "apply":
        result = commands.apply(store, config, args.view)
    elif args.command == "delete":
        result = commands.delete(store, config, args.view)
    elif args.command == "materialize":
        result = commands.materialize(store, config, args.view, args.start, args.end)
    elif args.command == "historical":
        result = commands.historical(
            store, config, args.entities, args.output, args.view, args.full_feature_names, args.s3_endpoint
        )
    else:
        commands.serve(store, config)
    return result


def _failure(error: BaseException) -> tuple[int, str, str]:
    """(exit code, reason, message) for an error; Feast's message is kept verbatim."""
    from loom.workloads.features.convert import MissingEnvironment

    if isinstance(error, WorkloadError):
        return error.exit_code, error.reason, str(error)
    if isinstance(error, (UnsupportedDtype, MissingEnvironment)):
        return EXIT_INVALID_CONFIG, InvalidConfig.reason, str(error)
    return EXIT_FAILED, WorkloadError.reason, f"{type(error).__name__}: {error}"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        result = run(args)
    except Exception as error:
        code: int
        code, reason, message = _failure(error)
        if code == EXIT_FAILED:
            traceback.print_exc()
        print(f"loom-features {args.command}: {reason}: {message}", file=sys.stderr)
        write_termination_message(args.termination_log, {"exitCode": code, "reason": reason, "message": message})
        return code
    if result is not None:
        line = json.dumps(result, separators=(",", ":"))
        print(line, flush=True)
        if args.result:
            Path(args.result).write_text(line)
        write_termination_message(args.termination_log, {"exitCode": EXIT_OK, **result})
    ok: int = EXIT_OK  # (mypy sees loom.* imports through the editable install as Any)
    return ok


if __name__ == "__main__":
    sys.exit(main())
