"""The registry of Loom's kinds, for the CRD generator and the operator's start-up. Each kind declares its `Kind`
(names, printer columns, name rule) beside its model, in kinds/<kind>/api.py; the pieces are in core/kind.py."""

from __future__ import annotations

from ..core.kind import (
    AGE,
    DNS_LABEL_PATTERN,
    DNS_LABEL_SHAPE,
    PHASE,
    Kind,
    NameRule,
    PrinterColumn,
)
from ..kinds.featureview.api import FEATURE_VIEW
from ..kinds.inferencegraph.api import INFERENCE_GRAPH
from ..kinds.inferenceservice.api import INFERENCE_SERVICE
from ..kinds.trainingjob.api import TRAINING_JOB

KINDS: tuple[Kind, ...] = (TRAINING_JOB, INFERENCE_SERVICE, INFERENCE_GRAPH, FEATURE_VIEW)

__all__ = [
    "AGE",
    "DNS_LABEL_PATTERN",
    "DNS_LABEL_SHAPE",
    "FEATURE_VIEW",
    "INFERENCE_GRAPH",
    "INFERENCE_SERVICE",
    "KINDS",
    "PHASE",
    "TRAINING_JOB",
    "Kind",
    "NameRule",
    "PrinterColumn",
]
