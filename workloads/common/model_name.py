"""The model-name rule of the inference protocol as Loom's servers apply it (/v2/models/<name>/infer).

The model server (modelName) and the InferenceGraph router (modelName of a step, graphName) refuse other names
at start, with this one rule. The names the operator hands them are Kubernetes object names already bounded
tighter by each kind's NameRule (operator/api/kinds.py: DNS-1035 labels of at most 63 characters).
"""

from __future__ import annotations

import re

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
MODEL_NAME_RULE = "1-128 characters of letters, digits, '_', '.', '-'"


def is_model_name(value: str) -> bool:
    """Whether `value` can be served as a model name: MODEL_NAME_RULE."""
    return _MODEL_NAME.match(value) is not None
