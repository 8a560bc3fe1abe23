"""`loom dev`: build, start and stop the local real control plane (dev and tests only).

`loom` finds this group through the `loom.cli` entry-point group (see pyproject.toml); the stack's code
(loom.devstack.cluster) is imported inside each command, so `loom --help` stays quick.
"""

from __future__ import annotations

import json

import click


@click.group()
def dev() -> None:
    """The local control plane: etcd, kube-apiserver, controller manager, scheduler, kwok GPU nodes."""


REAL_NODE_HELP = (
    "Also the real node: kubelet, containerd, runc, CNI plugins and kube-proxy on a bridge of the stack's own "
    "(needs root; its programs are built on first use)."
)


@dev.command()
@click.option("--real-node", is_flag=True, help=REAL_NODE_HELP)
def build(real_node: bool) -> None:
    """Build the control plane, kwok, kubectl and helm from their Go modules (cached; a rebuild is a no-op)."""
    from loom.devstack.cluster.build import build as build_stack
    from loom.devstack.cluster.build import build_node

    build_stack(progress=click.echo)
    if real_node:
        build_node(progress=click.echo)


@dev.command()
@click.option("--nodes", default=4, show_default=True, type=click.IntRange(0), help="Simulated kwok nodes.")
@click.option("--gpus-per-node", default=8, show_default=True, type=click.IntRange(0), help="nvidia.com/gpu per node.")
@click.option(
    "--agent-gpus", default=0, show_default=True, type=click.IntRange(0), help="GPUs the local node agent advertises."
)
@click.option("--real-node", is_flag=True, help=REAL_NODE_HELP)
def up(nodes: int, gpus_per_node: int, agent_gpus: int, real_node: bool) -> None:
    """Start the stack (building it first if needed); a no-op when it already runs like this."""
    from loom.devstack.backing import host_prometheus_url
    from loom.devstack.cluster import StackConfig
    from loom.devstack.cluster import up as stack_up
    from loom.devstack.cluster.handle import StackError

    shape = StackConfig(nodes=nodes, gpus_per_node=gpus_per_node, agent_gpus=agent_gpus, real_node=real_node)
    try:
        cluster = stack_up(shape, click.echo)
    except StackError as error:
        raise click.ClickException(str(error)) from None
    prometheus = host_prometheus_url()
    exports = f"\nexport LOOM_PROMETHEUS_URL={prometheus}" if prometheus else ""
    click.echo(f"ready: {cluster.server}\n{cluster.shell_exports()}{exports}")


@dev.command()
@click.option("--wipe", is_flag=True, help="Also delete the cluster's data, certificates and logs.")
def down(wipe: bool) -> None:
    """Stop every process of the stack."""
    from loom.devstack.cluster import down as stack_down

    stack_down(click.echo, wipe=wipe)


@dev.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(as_json: bool) -> None:
    """Which components run, where the API server listens, where the logs are."""
    from loom.devstack.cluster import status as stack_status

    report = stack_status()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for name, component in report["components"].items():
        state = f"running (pid {component['pid']})" if component["running"] else "stopped"
        click.echo(f"{name:24} {state:24} {component['log']}")
    if "server" in report:
        click.echo(f"server     {report['server']}")
    click.echo(f"kubeconfig {report['kubeconfig']}")


@dev.command()
def env() -> None:
    """Print the exports a shell needs: eval "$(loom dev env)". For an operator run here with `loom operator`: the
    workload images the stack answers to (LOOM_*_IMAGE) and, with the stack's Prometheus running,
    LOOM_PROMETHEUS_URL (its address from this machine)."""
    from loom.devstack.backing import host_prometheus_url
    from loom.devstack.cluster.build import is_built, stack_bin_dir
    from loom.devstack.cluster.lifecycle import StackState
    from loom.devstack.cluster.paths import KUBECONFIG
    from loom.devstack.images import IMAGE_ENV

    if not is_built():
        raise click.ClickException("the local stack is not built yet: `loom dev build` first")
    state = StackState.load()
    registry = f" LOOM_REGISTRY=127.0.0.1:{state.ports.registry}" if state and state.ports.registry else ""
    click.echo(f"export KUBECONFIG={KUBECONFIG} PATH={stack_bin_dir()}:$PATH{registry}")
    click.echo("export " + " ".join(f"{key}={value}" for key, value in sorted(IMAGE_ENV.items())))
    if (prometheus := host_prometheus_url()) is not None:
        click.echo(f"export LOOM_PROMETHEUS_URL={prometheus}")


@dev.command("gpu-utilization")
@click.option("-n", "--namespace", default="default", show_default=True, help="The InferenceService's namespace.")
@click.argument("service")
@click.argument("percent", type=click.FloatRange(0, 100))
def gpu_utilization(namespace: str, service: str, percent: float) -> None:
    """Set the GPU utilisation (PERCENT, 0-100) that the stack's simulated dcgm-exporter reports for the pods of
    InferenceService SERVICE on the simulated GPU node loom-simulated-gpu-0. No GPU runs on the local stack, so
    nothing measures it: this value is what Prometheus, and so the autoscaler, sees (0 until set)."""
    from loom.devstack.cluster import current
    from loom.devstack.simgpu import EXPORTER, NODE_NAME, set_utilization

    if (cluster := current()) is None:
        raise click.ClickException("the local stack is not up: `loom dev up` first")
    try:
        with cluster.api_client() as api:
            pods = set_utilization(api, namespace, service, percent)
    except LookupError as error:
        raise click.ClickException(str(error)) from None
    where = f"now on it: {', '.join(pods)}" if pods else "none of its pods is on it yet; those that land there will"
    click.echo(
        f"{EXPORTER} reports {percent:g}% GPU utilisation for the pods of inferenceservice {namespace}/{service}"
        f" on node {NODE_NAME} ({where})"
    )
