"""What every workload's configuration shares: the wire form (camelCase, unknown fields refused) and the one way
its file is read and written.

The operator renders a workload's config (a ``WorkloadConfig``) with ``to_json`` into a ConfigMap or an environment
variable and the pod reads it back with ``from_file`` or ``from_json``. Pydantic only, so the operator imports it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Self

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class CamelModel(BaseModel):
    """camelCase on the wire and snake_case in Python, as the Kubernetes objects they come from; an unknown field
    is an error, so a typo is reported instead of silently ignored; immutable once built."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class WorkloadConfig(CamelModel):
    """A workload's whole configuration: what the operator writes and the pod reads."""

    # The form `to_json` writes. Each config keeps the form it has always been rendered in: the pod template's
    # config hash covers the rendered text, so another form would roll every workload at an operator upgrade.
    json_indent: ClassVar[int | None] = None
    json_exclude_none: ClassVar[bool] = False

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls.model_validate(json.loads(text))

    @classmethod
    def from_file(cls, path: str | Path) -> Self:
        return cls.from_json(Path(path).read_text())

    @classmethod
    def from_file_or_env(cls, path: str | None, env_var: str) -> Self:
        """From the file given (--config), else from the environment variable the operator renders it into."""
        if path:
            return cls.from_file(path)
        text = os.environ.get(env_var)
        if not text:
            raise ValueError(f"no config: set {env_var} or pass --config")
        return cls.from_json(text)

    def to_json(self) -> str:
        """The rendered form: camelCase, defaults included so the pod sees exactly what was rendered."""
        return self.model_dump_json(by_alias=True, exclude_none=self.json_exclude_none, indent=self.json_indent)


def label_selector(labels: Mapping[str, str]) -> str:
    """Labels as a Kubernetes label selector (`kubectl get -l` form), as a config's pods are listed by it."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
