"""The `loom` verbs for people who train and serve: get, logs, wait, progress, predict, chat, run.

They join the `loom` command through the `loom.cli` entry points (pyproject.toml), and share kubectl's flags where
they overlap: -n/--namespace, --context, --kubeconfig, -o yaml|json, --timeout with units, --for=condition=...
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from loom.operator.api import Kind

F = TypeVar("F", bound=Callable[..., Any])


def cluster_options(fn: F) -> F:
    fn = click.option("-n", "--namespace", default=None, help="Namespace (default: the context's).")(fn)
    fn = click.option("--context", default=None, help="Kubeconfig context to use.")(fn)
    fn = click.option("--kubeconfig", default=None, type=click.Path(dir_okay=False), help="Kubeconfig file.")(fn)
    return fn


def connect(namespace: str | None, context: str | None, kubeconfig: str | None, url: str | None = None) -> Any:
    from .client import Client

    try:
        client = Client(namespace=namespace, context=context, kubeconfig=kubeconfig)
    except Exception as error:
        raise click.ClickException(f"cannot reach a cluster: {error}") from None
    if url:
        # Reach every Service at the address given (e.g. a port kubectl port-forward opened, an ingress).
        client.access = _FixedUrl(url.rstrip("/"))
    return client


class _FixedUrl:
    def __init__(self, url: str) -> None:
        self.url = url

    def open(self, url: str) -> Any:
        import contextlib

        @contextlib.contextmanager
        def fixed() -> Any:
            yield self.url

        return fixed()


def parse_duration(text: str) -> float:
    """kubectl's durations: 30s, 5m, 1h, 1h30m, or plain seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise click.BadParameter(f"{text!r} is not a duration (e.g. 90s, 10m, 1h)")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def _resource(text: str, name: str | None) -> tuple[Kind, str | None]:
    from .models import kind_named

    kind_text, _, inline = text.partition("/")
    try:
        kind = kind_named(kind_text)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    return kind, inline or name


def _dump(data: Any, output: str) -> str:
    import yaml

    if output == "json":
        return json.dumps(data, indent=2) + "\n"
    return yaml.safe_dump(data, sort_keys=False)


def _column(manifest: dict[str, Any], path: str) -> str:
    value: Any = manifest
    for part in path.lstrip(".").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def table(kind: Kind, items: list[dict[str, Any]], wide: bool) -> str:
    columns = [c for c in kind.columns if wide or c.priority == 0]
    rows = [["NAME", *[c.name.upper() for c in columns]]]
    for item in items:
        rows.append([item["metadata"]["name"], *[_column(item, c.json_path) for c in columns]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


@click.command()
@click.argument("resource")
@click.argument("name", required=False)
@click.option("-o", "--output", type=click.Choice(["yaml", "json", "wide", "name"]), default=None)
@click.option("-l", "--selector", default=None, help="Label selector, as kubectl's.")
@cluster_options
def get(resource: str, name: str | None, output: str | None, selector: str | None, namespace: str | None,
        context: str | None, kubeconfig: str | None) -> None:
    """Show Loom objects: `loom get trainingjobs`, `loom get ltj gpt -o yaml`, `loom get lis/chat`."""
    from .kube import NotFound

    kind, name = _resource(resource, name)
    client = connect(namespace, context, kubeconfig)
    try:
        if name:
            items = [client.get_manifest(kind, name)]
        else:
            query = [("labelSelector", selector)] if selector else []
            path = f"/apis/loom.dev/v1alpha1/namespaces/{client.namespace}/{kind.plural}"
            items = sorted(client.connection.call("GET", path, query=query).get("items", []),
                           key=lambda item: item["metadata"]["name"])
    except NotFound:
        raise click.ClickException(f'{kind.plural}.loom.dev "{name}" not found in {client.namespace}') from None
    for item in items:
        item.setdefault("apiVersion", "loom.dev/v1alpha1")
        item.setdefault("kind", kind.kind)
    if output in ("yaml", "json"):
        data: Any = items[0] if name else {"apiVersion": "v1", "kind": "List", "items": items}
        click.echo(_dump(data, output), nl=False)
    elif output == "name":
        for item in items:
            click.echo(f"{kind.singular}.loom.dev/{item['metadata']['name']}")
    elif not items:
        click.echo(f"No {kind.plural} found in {client.namespace} namespace.", err=True)
    else:
        click.echo(table(kind, items, wide=output == "wide"))


@click.command()
@click.argument("job")
@click.option("--worker", default=0, show_default=True, help="Worker index (0 is rank 0).")
@click.option("-f", "--follow", is_flag=True, help="Stream new lines until the worker ends.")
@click.option("--tail", default=None, type=int, help="Lines from the end.")
@cluster_options
def logs(job: str, worker: int, follow: bool, tail: int | None, namespace: str | None, context: str | None,
         kubeconfig: str | None) -> None:
    """A TrainingJob worker's log: `loom logs gpt --worker 1 -f`."""
    client = connect(namespace, context, kubeconfig)
    name = job.split("/", 1)[-1]
    try:
        for line in client.training(name).logs(worker=worker, follow=follow, tail=tail):
            click.echo(line)
    except LookupError as error:
        raise click.ClickException(str(error)) from None


def _target(condition: str) -> Any:
    from .waiting import Target

    key, _, rest = condition.partition("=")
    if key == "condition":
        cond, _, status = rest.partition("=")
        return Target(condition=cond, status=status or "True")
    if key == "phase":
        return Target(condition=None, phase=rest)
    match = re.fullmatch(r"jsonpath=\{?\.status\.phase\}?=(\w+)", condition)
    if match:
        return Target(condition=None, phase=match.group(1))
    raise click.BadParameter(f"--for={condition}: use condition=Ready, condition=Ready=False or phase=Succeeded")


@click.command()
@click.argument("resource")
@click.argument("name", required=False)
@click.option("--for", "for_", default="condition=Ready", show_default=True,
              help="condition=<Type>[=<status>] or phase=<Phase> (also jsonpath={.status.phase}=<Phase>).")
@click.option("--timeout", default="10m", show_default=True, help="How long to wait (30s, 10m, 1h).")
@cluster_options
def wait(resource: str, name: str | None, for_: str, timeout: str, namespace: str | None, context: str | None,
         kubeconfig: str | None) -> None:
    """Wait for a condition or phase: `loom wait trainingjob/gpt --for=phase=Succeeded --timeout=1h`. Fails at
    once, with the object's own message, when it can no longer get there."""
    from .client import WaitFailed, WaitTimeout

    kind, name = _resource(resource, name)
    if not name:
        raise click.BadParameter("name the object: loom wait <kind>/<name>")
    client = connect(namespace, context, kubeconfig)
    try:
        client.wait_for_manifest(kind, name, _target(for_), timeout=parse_duration(timeout))
    except (WaitFailed, WaitTimeout) as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"{kind.singular}.loom.dev/{name} condition met")


@click.command()
@click.argument("job")
@click.option("-w", "--watch", is_flag=True, help="A live progress bar until the job finishes.")
@click.option("-o", "--output", type=click.Choice(["line", "json"]), default="line")
@click.option("--timeout", default=None, help="Stop watching after this long (e.g. 30m).")
@cluster_options
def progress(job: str, watch: bool, output: str, timeout: str | None, namespace: str | None, context: str | None,
             kubeconfig: str | None) -> None:
    """A TrainingJob's progress: step, loss, throughput, ETA, restarts (`-w` for a live bar)."""
    client = connect(namespace, context, kubeconfig)
    training = client.training(job.split("/", 1)[-1])
    if watch:
        last = training.show(parse_duration(timeout) if timeout else None)
        if last.phase == "Failed":
            sys.exit(1)
        return
    now = training.progress()
    click.echo(json.dumps(now.__dict__) if output == "json" else now.line())


def _inputs(pairs: tuple[str, ...]) -> dict[str, Any]:
    inputs: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"--input {pair!r}: use name=<JSON array>, e.g. x=[[1.0,2.0]]")
        try:
            inputs[name] = json.loads(raw)
        except json.JSONDecodeError as error:
            raise click.BadParameter(f"--input {name}: not JSON: {error}") from None
    return inputs


@click.command()
@click.argument("service")
@click.option("-i", "--input", "pairs", multiple=True, help="A tensor: name=<JSON array> (repeatable).")
@click.option("--dtype", default=None, help="numpy dtype for every input (e.g. float32); default from the JSON.")
@click.option("--url", default=None, help="Reach the service at this base URL instead (an ingress, a port-forward).")
@click.option("--api-key", envvar="LOOM_API_KEY", default=None, help="API key (default: from spec.auth's Secret).")
@cluster_options
def predict(service: str, pairs: tuple[str, ...], dtype: str | None, url: str | None, api_key: str | None,
            namespace: str | None, context: str | None, kubeconfig: str | None) -> None:
    """Call an InferenceService (Open Inference Protocol v2): `loom predict chat -i x='[[1,2]]'`."""
    import numpy as np

    from .serving import ServiceError

    client = connect(namespace, context, kubeconfig, url)
    inputs = {name: np.asarray(value, dtype=dtype) for name, value in _inputs(pairs).items()}
    try:
        outputs = client.service(service.split("/", 1)[-1], api_key=api_key).predict(inputs)
    except ServiceError as error:
        raise click.ClickException(str(error)) from None
    click.echo(json.dumps({name: array.tolist() for name, array in outputs.items()}))


@click.command()
@click.argument("service")
@click.argument("prompt", required=False)
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--temperature", default=None, type=float)
@click.option("--no-stream", is_flag=True, help="Print the answer once it is complete.")
@click.option("--url", default=None, help="Reach the service at this base URL instead.")
@click.option("--api-key", envvar="LOOM_API_KEY", default=None, help="API key (default: from spec.auth's Secret).")
@cluster_options
def chat(service: str, prompt: str | None, max_tokens: int, temperature: float | None, no_stream: bool,
         url: str | None, api_key: str | None, namespace: str | None, context: str | None,
         kubeconfig: str | None) -> None:
    """Generate text with an InferenceService, streamed token by token (PROMPT, or stdin)."""
    from .serving import ServiceError

    text = prompt if prompt is not None else sys.stdin.read()
    params: dict[str, Any] = {"max_tokens": max_tokens}
    if temperature is not None:
        params["temperature"] = temperature
    client = connect(namespace, context, kubeconfig, url)
    target = client.service(service.split("/", 1)[-1], api_key=api_key)
    try:
        if no_stream:
            click.echo(target.generate(text, **params))
            return
        for piece in target.stream(text, **params):
            click.echo(piece, nl=False)
        click.echo()
    except ServiceError as error:
        raise click.ClickException(str(error)) from None


@click.command()
@click.option("-f", "--filename", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="YAML with one TrainingJob (and only Loom objects).")
@click.option("--local", is_flag=True, help="Run the task here under torchrun, without a cluster.")
@click.option("--processes", type=int, default=None, help="Local processes (default: workers.replicas x GPUs).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Local run folder (default .loom/local/<namespace>-<name>; a rerun resumes from it).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Checkpoint to this folder instead of the job's S3 (<dir>/<bucket>/<prefix>).")
@click.option("--tracking-uri", default=None, help="MLflow server to track to (default: the job's).")
@click.option("--wait/--no-wait", default=False, help="On a cluster: wait until it succeeds, with a progress bar.")
@cluster_options
def run(filename: Path, local: bool, processes: int | None, workdir: Path | None, checkpoint_dir: Path | None,
        tracking_uri: str | None, wait: bool, namespace: str | None, context: str | None,
        kubeconfig: str | None) -> None:
    """Run a TrainingJob: here (`--local`, same trainer, checkpoints, resume and MLflow code as in the cluster) or
    on the cluster (server-side apply, then optionally wait with a progress bar)."""
    from loom.operator.api import TrainingJob

    from .local import LocalRunRefused, run_local
    from .models import InvalidObject, load

    try:
        objects = load(filename)
    except (InvalidObject, ValueError) as error:
        raise click.ClickException(str(error)) from None
    jobs = [o for o in objects if isinstance(o, TrainingJob)]
    if len(jobs) != 1:
        raise click.ClickException(f"{filename} must hold exactly one TrainingJob (found {len(jobs)})")
    job = jobs[0]
    if local:
        if namespace:
            job.metadata["namespace"] = namespace
        try:
            outcome = run_local(job, processes=processes, workdir=workdir, checkpoint_dir=checkpoint_dir,
                                tracking_uri=tracking_uri)
        except (LocalRunRefused, InvalidObject) as error:
            raise click.ClickException(str(error)) from None
        click.echo(f"local run: exit {outcome.returncode}; checkpoint {outcome.checkpoint_uri or '-'}; "
                   f"model {outcome.model_uri or '-'}; MLflow run {outcome.mlflow_run_url or '-'}", err=True)
        sys.exit(0 if outcome.succeeded else outcome.returncode or 1)
    from .client import WaitFailed

    client = connect(namespace, context, kubeconfig)
    try:
        stored = client.apply(job)
    except InvalidObject as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"trainingjob.loom.dev/{stored.metadata['name']} applied")
    if wait:
        try:
            client.training(stored).wait(show=True, timeout=24 * 3600)
        except WaitFailed as error:
            raise click.ClickException(str(error)) from None


COMMANDS = {"get": get, "logs": logs, "wait": wait, "progress": progress, "predict": predict, "chat": chat,
            "run": run}
