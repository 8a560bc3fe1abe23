"""Kueue's Workload API under its old module name, for the InferenceService modules that still import it: removed
once inferenceservice moves onto core/queue/ (workload.py)."""

from __future__ import annotations

from .queue.workload import GROUP as GROUP
from .queue.workload import JOB_UID_LABEL as JOB_UID_LABEL
from .queue.workload import KUEUE_API_VERSION as KUEUE_API_VERSION
from .queue.workload import FlavorView as FlavorView
from .queue.workload import PodSet as PodSet
from .queue.workload import Position as Position
from .queue.workload import Priority as Priority
from .queue.workload import WorkloadView as WorkloadView
from .queue.workload import describe_flavors as describe_flavors
from .queue.workload import observe_workload as observe_workload
from .queue.workload import pending_positions as pending_positions
from .queue.workload import place as place
from .queue.workload import pod_template as pod_template
from .queue.workload import queue_name as queue_name
from .queue.workload import release as release
from .queue.workload import workload as workload
from .queue.workload import workload_name as workload_name

API_VERSION = KUEUE_API_VERSION  # removed once inferenceservice moves
