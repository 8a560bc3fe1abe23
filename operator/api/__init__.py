"""Loom's API (group loom.dev, version v1alpha1): pydantic models are the source of truth for the CRDs."""

from ..core.model import API_VERSION, GROUP, VERSION, Condition
from ..kinds.featureview.api import FeatureView, FeatureViewSpec, FeatureViewStatus
from ..kinds.inferencegraph.api import InferenceGraph, InferenceGraphSpec, InferenceGraphStatus
from ..kinds.inferenceservice.api import InferenceService, InferenceServiceSpec, InferenceServiceStatus
from ..kinds.trainingjob.api import TrainingJob, TrainingJobSpec, TrainingJobStatus
from .kinds import KINDS, Kind

__all__ = [
    "API_VERSION",
    "GROUP",
    "KINDS",
    "VERSION",
    "Condition",
    "FeatureView",
    "FeatureViewSpec",
    "FeatureViewStatus",
    "InferenceGraph",
    "InferenceGraphSpec",
    "InferenceGraphStatus",
    "InferenceService",
    "InferenceServiceSpec",
    "InferenceServiceStatus",
    "Kind",
    "TrainingJob",
    "TrainingJobSpec",
    "TrainingJobStatus",
]
