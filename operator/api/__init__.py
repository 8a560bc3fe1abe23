"""Loom's API (group loom.dev, version v1alpha1): pydantic models are the source of truth for the CRDs."""

from .common import API_VERSION, GROUP, VERSION, Condition
from .featureview import FeatureView, FeatureViewSpec, FeatureViewStatus
from .inferencegraph import InferenceGraph, InferenceGraphSpec, InferenceGraphStatus
from .inferenceservice import InferenceService, InferenceServiceSpec, InferenceServiceStatus
from .kinds import KINDS, Kind
from .trainingjob import TrainingJob, TrainingJobSpec, TrainingJobStatus

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
