"""The README's "Install on a real cluster" section as data, so tests hold the README to what the chart is.

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
# What the README's commands call the release, its namespace and the namespaces it watches.
RELEASE = "loom"
NAMESPACE = "loom-system"


def section(text: str, title: str = SECTION) -> str:
    """The body of the `## <title>` section of a Markdown document (up to the next `## ` heading)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    if match is None:
        raise ValueError(f"no section '## {title}'")
    return match.group(1)


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
    return commands(section(README.read_text()))


# The local-stack section's `helm install`: the chart with what the examples need (Prometheus, endpoint defaults).
LOCAL_SECTION = "Development: the local real stack"


def local_install_command() -> list[str]:
    """The one `helm install` of the README's local-stack section, as argv."""
    found = [argv for argv in commands(section(README.read_text(), LOCAL_SECTION)) if argv[:2] == ["helm", "install"]]
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


def adapt(argv: list[str], *, release: str, namespace: str, watch: list[str], extra_values: Path) -> list[str]:
    """One README command for a test install: the release, its namespace and the watched namespaces renamed,
    paths made absolute, and `helm install` given one more values file (`extra_values`: what the local stack
    needs, e.g. the node the pod must run on). Nothing else changes."""
    out = []
    for i, arg in enumerate(argv):
        previous = argv[i - 1] if i else ""
        if argv[0] == "helm" and i == 2 and arg == RELEASE:
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
    for argv in commands(section(README.read_text(), FEATURES_SECTION)):
        if argv[0] == "curl":
            url = next(arg for arg in argv[1:] if arg.startswith("http"))
            return url, flag_values(argv, "-d")[0]
    raise ValueError(f"no curl lookup in '## {FEATURES_SECTION}'")
