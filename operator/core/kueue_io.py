"""The Kueue reads under their old module name, for the InferenceService modules that still import them: removed
once inferenceservice moves onto core/queue/ (io.py)."""

from __future__ import annotations

from .queue.io import flavors as flavors
from .queue.io import positions as positions
from .queue.io import priority as priority
