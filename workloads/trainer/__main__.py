"""`python -m loom.workloads.trainer --config /etc/loom/trainer.json`, one process per rank under torchrun.

Exit codes (constants in loom.workloads.trainer.config): 0 success; 2 permanent (bad config, broken user
entrypoint: a clear message on stderr, in the progress file and in the termination log); 143 stopped by
SIGTERM after a final checkpoint; anything else retryable.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from pathlib import Path

from .config import (
    DEFAULT_PROGRESS_FILE,
    EXIT_INTERRUPTED,
    EXIT_PERMANENT,
    EXIT_RETRYABLE,
    ConfigError,
    load_config,
)
from .tracking import write_json_atomically, write_termination_message


def _report_failure(message: str, permanent: bool, progress_file: str) -> None:
    print(f"loom-trainer: {'permanent' if permanent else 'retryable'} failure: {message}", file=sys.stderr)
    write_termination_message(EXIT_PERMANENT if permanent else EXIT_RETRYABLE, message)
    if os.environ.get("RANK", "0") == "0":
        with contextlib.suppress(OSError):
            write_json_atomically(Path(progress_file), {"phase": "Failed", "message": message[-4000:],
                                                        "permanentFailure": permanent})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loom-trainer", description=__doc__)
    parser.add_argument("--config", required=True, help="path to the TrainerConfig JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    progress_file = DEFAULT_PROGRESS_FILE
    try:
        config = load_config(args.config)
        progress_file = config.progress.file
        from .loop import run

        # Rank 0 writes the exit-0 message itself (it names the final checkpoint); a stop on SIGTERM is
        # reported by every process, so each pod tells the operator it was interrupted, not broken.
        code = run(config)
        if code == EXIT_INTERRUPTED:
            write_termination_message(code, "stopped by SIGTERM after a final checkpoint")
        return code
    except ConfigError as error:
        _report_failure(str(error), permanent=True, progress_file=progress_file)
        return EXIT_PERMANENT
    except Exception as error:
        traceback.print_exc()
        _report_failure(f"{type(error).__name__}: {error}", permanent=False, progress_file=progress_file)
        return EXIT_RETRYABLE


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if code not in (0, EXIT_INTERRUPTED):
        # After a failure a checkpoint thread may still wait on a dead peer; a normal exit would join it
        # and hang until torchrun kills the process. Nothing left to save: leave now.
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
