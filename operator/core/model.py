"""Building blocks shared by every kind: the model base, Kubernetes-shaped sub-objects, conditions.

Field descriptions become `kubectl explain` text, so they are written for the person applying the object.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, ValidationError, WithJsonSchema
from pydantic.alias_generators import to_camel

GROUP = "loom.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
# The MLflow tags Loom writes: a registered version made by a TrainingJob (its uid), a version a canary analysis
# rolled back (why).
JOB_UID_TAG = "loom.dev/trainingjob-uid"
REJECTED_TAG = "loom.dev/rejected"

# A Kubernetes object as a plain dict, as the API server sends it and server-side apply takes it.
Manifest = dict[str, Any]


class ApiModel(BaseModel):
    """Base of every spec/status model: camelCase on the wire, snake_case in Python, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The object as Kubernetes stores it: camelCase, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class InvalidSpec(ValueError):
    """A spec the CRD's schema accepts but the kind cannot run (what admission cannot catch): reported in status
    as a condition, never a crash loop (core/reconcile.py turns it into the pass's `invalid` message)."""


def first_error(exc: ValidationError, prefix: str = "spec.") -> str:
    """The first validation error as one line, `<prefix><field path>: <message>`: what status says about a spec
    that does not validate (every kind's InvalidSpec message, so they all read alike)."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{prefix}{where}: {first.get('msg')}" if where else str(first.get("msg"))


def cel(
    rule: str, message: str, *, field_path: str | None = None, reason: str | None = None,
    message_expression: str | None = None,
) -> dict[str, str]:
    """One `x-kubernetes-validations` entry (a CEL rule checked by the API server at admission). A
    `message_expression` (CEL giving a string) says more than `message` can, e.g. which entry broke the rule; where
    it errs or gives a blank string the API server uses `message`."""
    entry = {"rule": rule, "message": message}
    if message_expression:
        entry["messageExpression"] = message_expression
    if field_path:
        entry["fieldPath"] = field_path
    if reason:
        entry["reason"] = reason
    return entry


def validations(*rules: dict[str, str]) -> ConfigDict:
    """Model config adding CEL rules to a model's schema (merged into ApiModel's config by pydantic)."""
    entries: list[JsonValue] = [dict(rule) for rule in rules]
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": entries})


# A Kubernetes resource quantity's syntax (as the API server's own CRD generator writes it for resource.Quantity).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not re.match(QUANTITY_PATTERN, value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 500m, 2, 1.5, 4Gi)")
    return value


# A Kubernetes resource quantity ("500m", "2Gi", 4): int-or-string on the wire. Checked at admission (the pattern):
# the API server checks a quantity only where it is a Pod's, so a bad one would otherwise surface as a pod the
# operator can never create.
Quantity = Annotated[
    int | str,
    AfterValidator(_quantity),
    WithJsonSchema({
        "x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
    }),
]

# A count or a percentage ("25%", 1), as a Deployment's maxSurge: int-or-string, checked by the API server in the
# Deployment.
IntOrPercent = Annotated[
    int | str,
    WithJsonSchema({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}),
]

# A free-form object (engine configs, raw env entries): kept as written, not pruned.
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DnsName = Annotated[str, Field(min_length=1, max_length=63, pattern=NAME_PATTERN)]


class ResourceRequirements(ApiModel):
    """Compute resources of one container, as in a Pod spec."""

    limits: dict[str, Quantity] | None = Field(None, description="Upper bounds, e.g. {cpu: 4, memory: 16Gi}.")
    requests: dict[str, Quantity] | None = Field(None, description="Amounts the scheduler reserves.")


class Toleration(ApiModel):
    """A Pod toleration, copied onto every pod Loom creates for this object."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class SecretKeySelector(ApiModel):
    """One key of a Secret in the object's namespace. Loom only references it; it never reads the value."""

    name: DnsName = Field(description="Name of the Secret.")
    key: str = Field(description="Key inside the Secret.", min_length=1, max_length=253)


class S3Credentials(ApiModel):
    """Where the pods find S3 credentials: a Secret in the object's namespace, injected as env by reference."""

    name: DnsName = Field(description="Name of the Secret holding the credentials.")
    access_key_id_key: str = Field("AWS_ACCESS_KEY_ID", description="Key of the access key id in the Secret.")
    secret_access_key_key: str = Field(
        "AWS_SECRET_ACCESS_KEY", description="Key of the secret access key in the Secret."
    )


class EnvVar(ApiModel):
    """An environment variable for the workload's containers (value or valueFrom, as in a Pod spec)."""

    name: str = Field(min_length=1, max_length=253)
    value: str | None = None
    value_from: FreeForm | None = Field(None, description="As in a Pod spec: secretKeyRef, configMapKeyRef, ...")


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    """A Kubernetes-convention condition: one observation about one aspect of the object."""

    type: str = Field(description="Condition type, e.g. Ready.")
    status: ConditionStatus
    reason: str = Field(description="One CamelCase word, for machines.")
    message: str = Field("", description="A sentence for humans.")
    last_transition_time: str | None = Field(None, description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(None, description="The metadata.generation this was computed from.")


def format_time(value: datetime) -> str:
    """RFC 3339 in UTC to the second, as Kubernetes writes timestamps (e.g. 2026-01-02T03:04:05Z)."""
    return value.astimezone(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def parse_time(value: str | None) -> datetime | None:
    """A Kubernetes timestamp as an aware UTC datetime; None for an empty value."""
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC)


def set_condition(conditions: list[Condition], new: Condition, now: datetime | None = None) -> list[Condition]:
    """Return conditions with `new` merged in; lastTransitionTime moves (to `now`, default the clock) only when
    the status changes. Conditions of other types are kept, in place."""
    stamp = format_time(now or datetime.now(UTC))
    merged: list[Condition] = []
    replaced = False
    for cond in conditions:
        if cond.type != new.type:
            merged.append(cond)
            continue
        replaced = True
        changed = cond.status != new.status
        when = new.last_transition_time or (stamp if changed else cond.last_transition_time)
        merged.append(new.model_copy(update={"last_transition_time": when}))
    if not replaced:
        merged.append(new.model_copy(update={"last_transition_time": new.last_transition_time or stamp}))
    return merged


class StatusBase(ApiModel):
    """Fields every kind's status has: Kubernetes conditions, a phase for humans, observedGeneration."""

    observed_generation: int | None = Field(None, description="The metadata.generation last reconciled.")
    conditions: list[Condition] = Field(default_factory=list, description="Current observations; Ready on every kind.")
    endpoint_defaults: dict[str, str] | None = Field(
        None,
        description="Operator defaults (chart values defaults.*) used for endpoint fields the spec leaves unset: "
        "field path -> value. Credentials appear as a Secret name only.",
    )
