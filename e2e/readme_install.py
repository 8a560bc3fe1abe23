"""The "Install on a real cluster" page of the documentation site (docs/tasks/install.md, moved there from the
README) as data, so tests hold the page to what the chart is; `page_section` reads the other pages the README's
sections moved to.

`tests/unit/test_readme_install.py` checks that every command and every chart value the section shows exists
(values.yaml, values.schema.json) and that the chart README's RBAC table is the chart's rules;
`e2e/tests/test_helm_install.py` runs the section's commands themselves, in order, on the local stack, with only
the release, its namespace and the watched namespaces renamed (`adapt`). Pure: no cluster, no helm.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CHART_DIR = "charts/loom"
SECTION = "Install on a real cluster"
DOCS = REPO / "docs"
# What the README's commands call the release, its namespace and the namespaces it watches.
RELEASE = "loom"
NAMESPACE = "loom-system"
# The values file `make images push` writes (images/push.py) and `helm install` reads.
PUSHED_VALUES = ".state/images/pushed-values.yaml"


def section(text: str, title: str = SECTION) -> str:
    """The body of the `## <title>` section of a Markdown document (up to the next `## ` heading)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    if match is None:
        raise ValueError(f"no section '## {title}'")
    return match.group(1)


# The sections the README had, by title, and the page of the documentation site each moved to (its `# <title>`).
PAGES = {
    SECTION: DOCS / "tasks" / "install.md",
    "Development: the local real stack": DOCS / "getting-started" / "local-stack.md",
    "Feature views": DOCS / "tasks" / "feature-views.md",
    "GitOps with Argo CD and Flux": DOCS / "tasks" / "gitops.md",
}


def page_section(title: str = SECTION) -> str:
    """The body of the page the README's `## <title>` section moved to (everything below its `# <title>`)."""
    heading, _, body = PAGES[title].read_text().partition("\n")
    if heading != f"# {title}":
        raise ValueError(f"{PAGES[title]} does not start with '# {title}'")
    return body


def commands(body: str) -> list[list[str]]:
    """The commands of the section's ```bash blocks, each as argv (continuation lines joined, comments dropped)."""
    found: list[list[str]] = []
    for block in re.findall(r"^```(?:bash|sh)\n(.*?)^```", body, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                found.append(argv)
    return found


def readme_commands() -> list[list[str]]:
    return commands(page_section())


def real_node_commands() -> list[list[str]]:
    """The section's walk on the local stack's real node: its ```shell block (kept apart from the real-cluster
    commands above, which `readme_commands` returns), as argv."""
    body = page_section()
    [block] = re.findall(r"^```shell\n(.*?)^```", body, flags=re.M | re.S)
    return commands(f"```bash\n{block}```\n")


# The local-stack section's `helm install`: the chart with what the examples need (Prometheus, endpoint defaults).
LOCAL_SECTION = "Development: the local real stack"


def local_install_command() -> list[str]:
    """The one `helm install` of the README's local-stack section, as argv."""
    found = [argv for argv in commands(page_section(LOCAL_SECTION)) if argv[:2] == ["helm", "install"]]
    if len(found) != 1:
        raise ValueError(f"expected one helm install in '## {LOCAL_SECTION}', found {len(found)}")
    return found[0]


def flag_values(argv: list[str], flag: str) -> list[str]:
    """Every value given to `flag` (`--set a=b` or `--set=a=b`)."""
    values = []
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values


def helm_value(text: str) -> Any:
    """A `--set` value as Helm reads it: `{a,b}` a list, true/false a bool, digits an int, else a string."""
    if text.startswith("{") and text.endswith("}"):
        return [item for item in text[1:-1].split(",") if item]
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return text


def set_values(argv: list[str]) -> dict[str, Any]:
    """The `--set key.path=value` pairs of one helm command, as {dotted key: value}."""
    pairs = {}
    for item in flag_values(argv, "--set"):
        key, _, value = item.partition("=")
        pairs[key] = helm_value(value)
    return pairs


def nest(pairs: dict[str, Any]) -> dict[str, Any]:
    """{"a.b": 1} -> {"a": {"b": 1}}."""
    tree: dict[str, Any] = {}
    for dotted, value in pairs.items():
        *parents, leaf = dotted.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def inline_values(body: str) -> dict[str, str | None]:
    """Chart values the prose names in inline code: `--set replicas=2`, `webhook.failurePolicy: Ignore`,
    `metrics.serviceMonitor.enabled` -> {dotted key: the value shown, or None}. File names and API groups
    (`values.schema.json`, `loom.dev`) are not values and are left out by their suffix, fields of Loom's objects
    (`status.endpointDefaults`) by their first part."""
    found: dict[str, str | None] = {}
    for code in re.findall(r"`([^`\n]+)`", body):
        code = code.removeprefix("--set ").strip()
        match = re.fullmatch(r"([a-z][A-Za-z0-9]*(?:\.[a-z][A-Za-z0-9]*)*)(?:=(\S+)|:\s+(\S+))?", code)
        if match is None or re.search(r"\.(json|ya?ml|md|py|lua|dev)$|^(spec|status|metadata)\.", match.group(1)):
            continue  # also left out: `models:/` (a URI scheme: a value follows `=` or `: `), fields of objects
        key, value = match.group(1), match.group(2) or match.group(3)
        if "." in key or value is not None:  # a lone word is prose (`patch`, `json`), not a value path
            found[key] = value
    return found


def environment(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """`REGISTRY=x make images push` -> ({"REGISTRY": "x"}, ["make", "images", "push"])."""
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        key, _, value = argv[0].partition("=")
        env[key] = value
        argv = argv[1:]
    return env, argv


def adapt(
    argv: list[str],
    *,
    release: str,
    namespace: str,
    watch: list[str],
    extra_values: Path,
    registry: str = "",
    images_state: Path | None = None,
) -> list[str]:
    """One README command for a test install: the release, its namespace and the watched namespaces renamed,
    paths made absolute, and `helm install` given one more values file (`extra_values`: what the local stack
    needs, e.g. the node the pod must run on). The push goes to `registry` (the local stack's, plain HTTP) from
    `images_state`, where the test built small stand-ins of the images (`make images` would build the real ones
    for half an hour: the push and what follows are the same), and the install reads the values it wrote there.
    Nothing else changes."""
    env, command = environment(argv)
    if command[:2] == ["make", "images"] and "push" in command:
        assert images_state is not None and registry, "a README push needs a registry and the images to push"
        pushed = {**env, "REGISTRY": registry, "TLS_VERIFY": "false", "LOOM_IMAGES_STATE": str(images_state)}
        return [f"{key}={value}" for key, value in pushed.items()] + ["make", "-C", str(REPO), "push"]
    out = []
    for i, arg in enumerate(argv):
        previous = argv[i - 1] if i else ""
        if previous == "-f" and arg == PUSHED_VALUES and images_state is not None:
            arg = str(images_state / Path(PUSHED_VALUES).name)
        elif argv[0] == "helm" and i == 2 and arg == RELEASE:
            arg = release
        elif previous in ("-n", "--namespace") and arg == NAMESPACE:
            arg = namespace
        elif arg == CHART_DIR or arg.startswith("crds/") or arg == "crds":
            arg = str(REPO / arg)
        elif arg.startswith(f"deployment/{RELEASE}-"):
            arg = f"deployment/{release}-" + arg.removeprefix(f"deployment/{RELEASE}-")
        elif previous == "--set" and arg.startswith("watchNamespaces="):
            arg = "watchNamespaces={" + ",".join(watch) + "}"
        out.append(arg)
    if argv[:2] == ["helm", "install"]:
        out += ["-f", str(extra_values)]
    return out


# The Feature views section's lookup: `curl -s <status.url>/get-online-features -H ... -d '<json>'`.
FEATURES_SECTION = "Feature views"


def feature_lookup() -> tuple[str, str]:
    """(the URL the README POSTs to, the JSON body it sends) of the Feature views section's curl lookup."""
    for argv in commands(page_section(FEATURES_SECTION)):
        if argv[0] == "curl":
            url = next(arg for arg in argv[1:] if arg.startswith("http"))
            return url, flag_values(argv, "-d")[0]
    raise ValueError(f"no curl lookup in '## {FEATURES_SECTION}'")
