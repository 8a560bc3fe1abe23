"""`python -m loom.devstack.agent`: run the node agent.

Exit modes:
- SIGTERM/SIGINT (`loom dev down`): stop every pod's processes (SIGTERM, SIGKILL after at most
  --exit-grace seconds, so the stack's own 10s stop grace is enough), then exit: nothing is left behind.
- SIGHUP (restart in place): exit and leave the pods running. They live in their own sessions with
  their state in --state-dir; the next agent re-adopts them, learns how those that ended meanwhile
  exited, and kills those whose pods were deleted while it was away. A crash or SIGKILL is the same.

One agent per state dir: a new agent asks the one holding <state>/agent.lock to leave (SIGHUP) and
takes over, so two never run pods from the same state at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loom.devstack.agent.config import AgentConfig, machine_memory
from loom.devstack.agent.shim import build_shim


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loom.devstack.agent", description=__doc__)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node-name", default="loom-local")
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--kubelet-port", type=int, default=10250)
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--gpus", type=int, default=0, help="count of nvidia.com/gpu to advertise")
    parser.add_argument("--cpu", default=str(os.cpu_count() or 1))
    parser.add_argument("--memory", default=machine_memory())
    parser.add_argument("--max-pods", type=int, default=110)
    parser.add_argument("--backoff-initial", type=float, default=2.0, help="first restart back-off (seconds)")
    parser.add_argument("--backoff-max", type=float, default=60.0)
    parser.add_argument(
        "--exit-grace", type=float, default=5.0, help="at most this many seconds of grace for pods stopped on SIGTERM"
    )
    parser.add_argument(
        "--image-env",
        action="append",
        default=[],
        metavar="NAME=BIN_DIR",
        help="containers whose image repository is NAME run their programs from BIN_DIR (repeatable), e.g. "
        "vllm=<checkout>/.venv-vllm/bin; other images run from this agent's virtualenv",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def image_environments(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    """`--image-env NAME=BIN_DIR` values as (name, absolute bin folder) pairs."""
    out = []
    for pair in pairs:
        name, sep, bin_dir = pair.partition("=")
        if not sep or not name or not bin_dir:
            raise SystemExit(f"--image-env {pair!r}: expected NAME=BIN_DIR")
        out.append((name, os.path.abspath(bin_dir)))
    return tuple(out)


async def take_over(state_dir: Path, wait_seconds: float = 30.0) -> int:
    """Become the only agent on this state dir; returns the lock's file descriptor (keep it open).

    An agent already holding the lock is asked to leave as on SIGHUP (its pods keep running and are
    re-adopted here), so the newest agent wins: the one the stack's process record names."""
    fd = os.open(state_dir / "agent.lock", os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_seconds
    asked = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode().strip()
            if holder.isdigit() and int(holder) != os.getpid():
                sig = signal.SIGHUP if not asked else (signal.SIGKILL if time.monotonic() > deadline else 0)
                with contextlib.suppress(ProcessLookupError):
                    if sig:
                        os.kill(int(holder), sig)
                asked = True
            await asyncio.sleep(0.2)  # the warmed-up proxies keep serving meanwhile
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


async def amain(args: argparse.Namespace) -> None:
    from loom.devstack.agent.agent import Agent

    state_dir: Path = args.state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)

    cfg = AgentConfig(
        kubeconfig=args.kubeconfig,
        node_name=args.node_name,
        state_dir=state_dir,
        kubelet_port=args.kubelet_port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        gpus=args.gpus,
        cpu=args.cpu,
        memory=args.memory,
        max_pods=args.max_pods,
        backoff_initial=args.backoff_initial,
        backoff_max=args.backoff_max,
        bin_dir=os.path.dirname(sys.executable),
        shim_path=str(build_shim(state_dir)),
        image_environments=image_environments(args.image_env),
    )
    loop = asyncio.get_running_loop()
    # API calls run in threads; on a 2-core machine the default pool (cores + 4) is too small for
    # status patches of many pods alongside slower calls.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=32, thread_name_prefix="api"))
    agent = Agent(cfg)
    await agent.warm_up()
    await take_over(state_dir)
    runner = asyncio.create_task(agent.run())
    stop_pods = True

    def leave(keep_pods: bool) -> None:
        nonlocal stop_pods
        stop_pods = not keep_pods
        agent.drain_seconds = args.exit_grace if keep_pods else 0.0  # the new agent already accepts
        runner.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, leave, False)
    loop.add_signal_handler(signal.SIGHUP, leave, True)
    with contextlib.suppress(asyncio.CancelledError):
        await runner
    if stop_pods:
        await agent.stop_all_pods(args.exit_grace)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("kubernetes", "httpx", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
