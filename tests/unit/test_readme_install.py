"""The "Install on a real cluster" page (docs/tasks/install.md, the README's section until #49) and the chart
README's RBAC table hold to the chart.

Without a cluster or helm: every chart value the section shows (in its commands and in its prose) exists in
values.yaml and passes values.schema.json; the commands name the chart, the CRDs and the Deployment the chart
makes; the RBAC table of charts/loom/README.md is exactly the rules the templates grant, and the section's RBAC
summary (no wildcard, no Secrets) is true of them. `e2e/tests/test_helm_install.py` runs the same commands on the
local stack (`test_the_readmes_install_upgrade_and_uninstall_commands_work`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from loom.e2e.readme_install import (
    CHART_DIR,
    NAMESPACE,
    PUSHED_VALUES,
    RELEASE,
    REPO,
    SECTION,
    adapt,
    commands,
    environment,
    flag_values,
    inline_values,
    nest,
    page_section,
    readme_commands,
    section,
    set_values,
)
from loom.e2e.stack_images import push_tool

CHART = REPO / CHART_DIR
BODY = page_section()


def defaults() -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "values.yaml").read_text()))


def schema() -> dict[str, Any]:
    return dict(json.loads((CHART / "values.schema.json").read_text()))


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def known(dotted: str) -> bool:
    """The value path exists: in values.yaml, or (a value unset by default) in the schema's properties."""
    node: Any = defaults()
    props: Any = schema()
    for part in dotted.split("."):
        in_values = isinstance(node, dict) and part in node
        in_schema = isinstance(props, dict) and part in props.get("properties", {})
        if not (in_values or in_schema):
            return False
        node = node.get(part) if in_values else None
        props = props["properties"][part] if in_schema else {}
    return True


def schema_errors(values: dict[str, Any]) -> list[str]:
    return [e.message for e in jsonschema.Draft7Validator(schema()).iter_errors(values)]


def helm_commands() -> list[list[str]]:
    return [argv for argv in readme_commands() if argv[0] == "helm"]


def pushed_values(argv: list[str]) -> dict[str, Any]:
    """What `make images push` writes for the registry the README's push names (images/push.py's own function),
    with made-up digests."""
    env, command = environment(argv)
    assert command == ["make", "images", "push"], command
    push = push_tool()
    digests = {name: "sha256:" + f"{i}" * 64 for i, name in enumerate(push.NAMES)}
    return dict(push.helm_values(push.check_registry(env["REGISTRY"]), digests))


def installed_values(argv: list[str]) -> dict[str, Any]:
    """The values `helm install` gets from the files the README gives it (the chart's defaults under them)."""
    values = defaults()
    for path in flag_values(argv, "-f"):
        assert path == PUSHED_VALUES, f"helm install -f {path}: not the file `make images push` writes"
        values = merged(values, pushed_values(readme_commands()[0]))
    return values


def test_the_section_shows_push_install_upgrade_and_uninstall_of_this_chart() -> None:
    shown = [environment(argv)[1][:2] for argv in readme_commands()]
    assert shown == [
        ["make", "images"],  # REGISTRY=... make images push
        ["helm", "install"],
        ["kubectl", "-n"],  # rollout status
        ["kubectl", "apply"],  # the CRDs
        ["helm", "upgrade"],
        ["helm", "uninstall"],
    ]
    for argv in helm_commands():
        assert argv[2] == RELEASE and argv[argv.index("-n") + 1] == NAMESPACE, argv
        if argv[1] in ("install", "upgrade"):
            assert argv[3] == CHART_DIR and (CHART / "Chart.yaml").is_file()


def test_every_value_the_commands_set_exists_and_passes_the_schema() -> None:
    install = helm_commands()[0]
    # The chart's defaults name no image: without what `make images push` wrote, the install is refused.
    assert schema_errors(defaults()) and schema_errors(merged(defaults(), nest(set_values(install))))
    assert schema_errors(installed_values(install) | nest(set_values(install))) == []
    shown = [set_values(argv) for argv in helm_commands()]
    assert shown[0], "helm install sets no value"
    for pairs in shown:
        for key in pairs:
            assert known(key), f"--set {key}: not a value of charts/loom"
        assert schema_errors(merged(installed_values(install), nest(pairs))) == [], pairs


def test_the_push_writes_what_pins_every_image_by_digest() -> None:
    values = pushed_values(readme_commands()[0])
    assert values["image"]["registry"] == "registry.example.com/loom" and values["image"]["digest"]
    assert set(values["workloadImages"]) == {"trainer", "server", "router", "features", "vllm"}
    assert values["workloadImages"]["router"] == values["workloadImages"]["server"]  # the router is the server image


def test_every_value_the_prose_names_exists_and_the_values_it_shows_pass_the_schema() -> None:
    named = inline_values(BODY)
    assert {"replicas", "webhook.failurePolicy", "metrics.serviceMonitor.enabled", "image.registry"} <= set(named)
    base = installed_values(helm_commands()[0])
    for key, value in named.items():
        assert known(key), f"`{key}` is not a value of charts/loom"
        if value is not None:
            shown = yaml.safe_load(value)  # `replicas=2` -> 2, `logFormat=json` -> "json"
            assert schema_errors(merged(base, nest({key: shown}))) == [], (key, value)


def test_the_commands_name_what_the_chart_makes() -> None:
    [rollout] = [argv for argv in readme_commands() if "rollout" in argv]
    # The chart names the Deployment `<release>-operator` (templates/_helpers.tpl).
    assert 'printf "%s-operator" .Release.Name' in (CHART / "templates" / "_helpers.tpl").read_text()
    assert rollout[-1] == f"deployment/{RELEASE}-operator" and rollout[rollout.index("-n") + 1] == NAMESPACE
    [crds] = [argv for argv in readme_commands() if argv[:2] == ["kubectl", "apply"]]
    folder = REPO / crds[crds.index("-f") + 1]
    # What the upgrade applies is what the chart installed first (Helm never upgrades crds/).
    assert {p.name: p.read_text() for p in folder.glob("*.yaml")} == {
        p.name: p.read_text() for p in (CHART / "crds").glob("loom.dev_*.yaml")
    }


def test_a_value_that_does_not_exist_is_caught() -> None:
    """The checks above can fail: a misspelt value or a bad one in the README would be refused."""
    assert not known("webhook.failurPolicy") and not known("prometheus.uri")
    assert schema_errors(merged(defaults(), nest({"replicas": "two"})))
    assert inline_values(
        "run `--set replicas=2` and see `values.schema.json`, `loom.dev`, `patch`, `models:/`, `spec.replicas`"
    ) == {"replicas": "2"}


def test_adapt_renames_only_the_release_its_namespace_and_the_watched_namespaces(tmp_path: Path) -> None:
    push, install, rollout, crds, upgrade, uninstall = (
        adapt(
            argv,
            release="r1",
            namespace="r1-system",
            watch=["w1", "w2"],
            extra_values=tmp_path / "v.yaml",
            registry="127.0.0.1:5000/loom",
            images_state=tmp_path / "images",
        )
        for argv in readme_commands()
    )
    # The push goes to the given registry from the given image storage, without the half-hour build.
    env, command = environment(push)
    assert command == ["make", "-C", str(REPO), "push"]
    assert env == {
        "REGISTRY": "127.0.0.1:5000/loom",
        "TLS_VERIFY": "false",
        "LOOM_IMAGES_STATE": str(tmp_path / "images"),
    }
    assert install[:6] == ["helm", "install", "r1", str(CHART), "-n", "r1-system"]
    assert flag_values(install, "-f") == [str(tmp_path / "images" / "pushed-values.yaml"), str(tmp_path / "v.yaml")]
    assert "watchNamespaces={w1,w2}" in install and install[-2:] == ["-f", str(tmp_path / "v.yaml")]
    assert rollout[-1] == "deployment/r1-operator" and rollout[2] == "r1-system"
    assert crds[-1] == str(REPO / "crds/")
    assert upgrade[:3] == ["helm", "upgrade", "r1"] and "--reuse-values" in upgrade
    assert uninstall == ["helm", "uninstall", "r1", "-n", "r1-system"]


def test_commands_are_read_from_bash_blocks_only() -> None:
    text = "```bash\nhelm install a b \\\n  --set x=1   # why\n# a comment\n```\n```yaml\nkey: v\n```\n"
    assert commands(text) == [["helm", "install", "a", "b", "--set", "x=1"]]


# ------------------------------------------------------------------------------------------------------ RBAC


def template_rules(name: str) -> list[dict[str, Any]]:
    """The ClusterRole rules of one template, read as YAML with the template actions replaced by a word."""
    text = (CHART / "templates" / name).read_text()
    lines = [line for line in text.splitlines() if not re.fullmatch(r"\s*\{\{-?.*-?\}\}\s*", line)]
    docs = yaml.safe_load_all(re.sub(r"\{\{-?.*?-?\}\}", "X", "\n".join(lines)))
    return [rule for doc in docs if doc and doc["kind"] == "ClusterRole" for rule in doc["rules"]]


def granted() -> set[tuple[str, str, str, bool]]:
    """(API group, resource, verb, limited to named objects) of every rule the chart renders."""
    return {
        (group, resource, verb, "resourceNames" in rule)
        for name in ("rbac.yaml", "peering.yaml")
        for rule in template_rules(name)
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def table_rules(readme: str | None = None) -> set[tuple[str, str, str, bool]]:
    """The same, from the RBAC table of charts/loom/README.md."""
    body = section(readme or (CHART / "README.md").read_text(), "RBAC (least privilege)")
    rows = [line for line in body.splitlines() if line.startswith("| ") and not line.startswith("| API group")]
    assert rows, "no RBAC table"
    found = set()
    for row in rows:
        groups, resources, verbs = (cell.strip() for cell in row.strip("|").split("|")[:3])
        named = "only)" in resources
        for group in re.sub(r"[`\s]", "", groups).split(","):
            for resource in re.sub(r"\(.*?\)|\s", "", resources).split(","):
                for verb in re.sub(r"\s", "", verbs).split(","):
                    found.add(("" if group == "core" else group, resource, verb, named))
    return found


def test_the_chart_readmes_rbac_table_is_the_charts_rules() -> None:
    table, chart = table_rules(), granted()
    assert table - chart == set(), "the README grants what the chart does not"
    assert chart - table == set(), "the chart grants what the README does not say"


def test_the_install_sections_rbac_summary_is_true() -> None:
    assert "no wildcard, and no rule names Secrets" in BODY
    for group, resource, verb, _ in granted():
        assert "*" not in (group, resource, verb)
        assert resource.split("/")[0] != "secrets"


@pytest.mark.parametrize("row", ["| core | secrets | get | x |", "| `apps` | deployments | get, update | x |"])
def test_a_table_row_the_chart_lacks_would_be_caught(row: str) -> None:
    text = (CHART / "README.md").read_text().replace("| core | events | create |", row + "\n| core | events | create |")
    assert table_rules(text) - granted()


@pytest.mark.parametrize("title", [SECTION, "GitOps with Argo CD and Flux"])
def test_every_file_the_install_and_gitops_sections_name_exists(title: str) -> None:
    """The tests and files these sections cite as proof (test_gitops.py, the Argo CD health script, ...) exist."""
    named = [
        code
        for code in re.findall(r"`([^`\s]+)`", page_section(title))
        if "/" in code
        and ":" not in code
        and not code.startswith("-")
        and re.search(r"\.(py|lua|yaml|md|json)$|/$", code)
    ]
    assert named, title
    assert [path for path in named if not (REPO / path).exists()] == []


def test_the_local_stack_install_gives_the_chart_the_stacks_services_for_the_examples() -> None:
    """The README's local-stack `helm install` sets what the examples need, with the names `loom dev up` gives
    its services (the autoscaling examples read Prometheus; the endpoint defaults fill what an object leaves
    unset), and only chart values that exist and pass the schema. e2e/tests/test_examples.py runs it."""
    from loom.devstack import backing
    from loom.e2e.readme_install import local_install_command

    argv = local_install_command()
    assert argv[:5] == ["helm", "install", RELEASE, CHART_DIR, "-n"] and argv[5] == NAMESPACE
    values = set_values(argv)
    assert values["prometheus.url"] == backing.PROMETHEUS_URL
    assert values["defaults.s3.endpoint"] == backing.S3_URL
    assert values["defaults.s3.secretName"] == backing.SECRET_NAME
    assert values["defaults.mlflow.trackingUri"] == backing.MLFLOW_URL
    assert values["watchNamespaces"] == ["default"]  # where `loom dev up` puts the examples' Secrets
    schema = json.loads((CHART / "values.schema.json").read_text())
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, value in nest(values).items():
        merged[key] = {**merged[key], **value} if isinstance(value, dict) else value
    jsonschema.validate(merged, schema)


def test_the_readmes_feature_lookup_uses_the_references_status_gives() -> None:
    """The README's FeatureView lookup names features as status.featureRefs does (driver_stats:..., not the
    Kubernetes name driver-stats), for the example view, at the Service the operator names; the e2e test
    test_featureview.py runs it."""
    from loom.e2e.readme_install import feature_lookup
    from loom.operator.kinds.featureview.config import feature_refs, project_object_name

    url, body = feature_lookup()
    view = yaml.safe_load((REPO / "examples" / "featureview-driver-stats.yaml").read_text())
    refs = feature_refs(view["metadata"]["name"], [f["name"] for f in view["spec"]["features"]])
    request = json.loads(body)
    assert request["features"] and set(request["features"]) <= set(refs)
    assert list(request["entities"]) == [view["spec"]["entities"][0]["name"]]
    service = project_object_name(view["spec"]["project"])
    assert url == f"http://{service}.default.svc/get-online-features"  # status.url + the lookup's path
