"""A live TrainingJob progress bar with rich: it redraws in place in a terminal and in a Jupyter notebook (rich
renders there through IPython's display), and prints plain lines when the output is neither (a pipe, a CI log)."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from .training import TrainingProgress


class ProgressBar:
    def __init__(self, title: str, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)
        self.live = self.console.is_terminal or self.console.is_jupyter
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            console=self.console,
            transient=False,
        )
        self.task = self.progress.add_task(title, total=None, detail="Pending")
        self._last_line = ""

    def __enter__(self) -> ProgressBar:
        if self.live:
            self.progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.live:
            self.progress.stop()

    def update(self, progress: TrainingProgress) -> None:
        detail = progress.line().split(" ", 1)[0] + "  " + _fields(progress)
        self.progress.update(self.task, total=progress.total_steps, completed=progress.step, detail=detail)
        if not self.live:
            line = progress.line()
            if line != self._last_line:
                self.console.print(line, soft_wrap=True)
                self._last_line = line


def _fields(progress: TrainingProgress) -> str:
    loss = f"{progress.loss:.3f}" if progress.loss is not None else "-"
    speed = f"{progress.throughput:,.1f}/s" if progress.throughput is not None else "-"
    return f"loss {loss}  {speed}  ETA {progress.eta or '-'}  restarts {progress.restarts}"
