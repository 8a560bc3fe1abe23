"""The model-name rule of the inference protocol as Loom's servers apply it (/v2/models/<name>/infer).

The model server (modelName), the LLM server (modelName and each adapter's name) and the InferenceGraph router
(modelName of a step, graphName) refuse other names at start, with this one rule: each such field is a
`ModelName` (or a `model_name(...)` naming itself otherwise in the error). The names the operator hands them are
Kubernetes object names already bounded tighter by each kind's NameRule (operator/api/kinds.py: DNS-1035 labels
of at most 63 characters).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
MODEL_NAME_RULE = "1-128 characters of letters, digits, '_', '.', '-'"


def model_name(label: str) -> AfterValidator:
    """The rule as a validator whose error names the value as `label` (the field's wire name, or what it is)."""

    def check(value: str) -> str:
        if _MODEL_NAME.match(value) is None:
            raise ValueError(f"{label} must be {MODEL_NAME_RULE}, got {value!r}")
        return value

    return AfterValidator(check)


# A model name clients use, in a field called modelName.
ModelName = Annotated[str, model_name("modelName")]
