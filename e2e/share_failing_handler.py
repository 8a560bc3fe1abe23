"""A model server handler for the promotion e2e test: the noop handler (it echoes its inputs), except that a model
folder holding the file `fail-every` (a number N) makes it fail every N-th request with a 500, as a deliberately
broken model version would. The server loads it as `handler: loom.e2e.share_failing_handler:ShareFailingModel`
(the local stack's pods run from the checkout's environment, where loom.e2e is installed)."""

from __future__ import annotations

import itertools
from pathlib import Path

from loom.workloads.server.errors import InferenceError
from loom.workloads.server.handlers import NoopModel
from loom.workloads.server.model import InferRequest, InferResponse

MARKER = "fail-every"
MESSAGE = "deliberately broken model version"


class ShareFailingModel(NoopModel):
    platform = "share-failing"

    def load(self, folder: Path) -> None:
        super().load(folder)
        marks = sorted(folder.rglob(MARKER))
        self.fail_every = int(marks[0].read_text().strip()) if marks else 0
        self._count = itertools.count(1)

    def predict(self, batch: list[InferRequest]) -> list[InferResponse | Exception]:
        results = super().predict(batch)
        if self.fail_every <= 0:
            return results
        # Every N-th request, counted over this replica's life: an exact share of what the replica answers.
        return [
            InferenceError(MESSAGE) if next(self._count) % self.fail_every == 0 else result for result in results
        ]
