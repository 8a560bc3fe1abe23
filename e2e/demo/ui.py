"""The demo's terminal output, with rich: a rule per part, one-line outcomes, the training progress bar, the
streamed generation and the summary table. Not on a terminal (CI logs, a pipe) it writes plain lines: no
colours, no live bar, a progress line only when the step crosses a tenth of the run or the phase changes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table


@dataclass
class TrainingView:
    """What the TrainingJob's status says, as the bar shows it."""

    phase: str = "Pending"
    step: int = 0
    total: int = 0
    loss: float | None = None
    throughput: float | None = None  # samples or tokens per second, as the trainer reports
    eta: str | None = None  # as the status says it, e.g. 1m20s
    restarts: int = 0

    def fields(self) -> str:
        loss = f"{self.loss:.3f}" if self.loss is not None else "-"
        speed = f"{self.throughput:,.0f}/s" if self.throughput else "-"
        eta = self.eta or "-"
        return f"{self.phase:<10} loss {loss:>5} {speed:>7} ETA {eta:>5} restarts {self.restarts}"


class Ui:
    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)
        self.live = self.console.is_terminal

    def part(self, number: int, total: int, title: str, what: str) -> None:
        if self.live:
            self.console.rule(f"[bold]{number}/{total} {title}")
        else:
            self.console.print(f"== {number}/{total} {title}")
        self.console.print(what, style="dim")

    def info(self, text: str) -> None:
        self.console.print(f"  {text}", soft_wrap=True)

    def outcome(self, text: str) -> None:
        self.console.print(f"[green]✔[/] {text}" if self.live else f"OK {text}", soft_wrap=True)

    def failed(self, text: str) -> None:
        self.console.print(f"[red]✘[/] {text}" if self.live else f"FAILED {text}", soft_wrap=True)

    @contextlib.contextmanager
    def training(self, title: str) -> Iterator[TrainingBar]:
        bar = TrainingBar(self, title)
        try:
            if self.live:
                with bar.progress:
                    yield bar
            else:
                yield bar
        finally:
            bar.close()

    def tokens(self) -> TokenPrinter:
        return TokenPrinter(self.console)

    def summary(self, rows: list[tuple[str, str, float, str]]) -> None:
        # Plain ASCII off a terminal: CI logs and pipes may not render box drawing characters.
        table = Table(title="Loom demo" if self.live else None, box=box.HEAVY_HEAD if self.live else box.ASCII)
        for column, justify in (("part", "left"), ("outcome", "left"), ("time", "right"), ("key figure", "left")):
            table.add_column(column, justify=justify)  # type: ignore[arg-type]
        for part, state, seconds, figure in rows:
            table.add_row(part, state, f"{seconds:.0f}s", figure)
        self.console.print(table)

    def look(self, lines: list[tuple[str, str]]) -> None:
        self.console.print("[bold]Where to look[/]" if self.live else "Where to look")
        for what, where in lines:
            self.console.print(f"  {what:<26} {where}", soft_wrap=True)


class TrainingBar:
    def __init__(self, ui: Ui, title: str) -> None:
        self.ui = ui
        self.view = TrainingView()
        self.progress = Progress(
            TextColumn(f"  {title}"),
            BarColumn(bar_width=12),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            console=ui.console,
        )
        self.task = self.progress.add_task(title, total=None, status="")
        self._printed: tuple[str, int, int] | None = None

    def update(self, view: TrainingView) -> None:
        self.view = view
        if self.ui.live:
            self.progress.update(self.task, completed=view.step, total=view.total or None, status=view.fields())
            return
        tenth = (view.step * 10 // view.total) if view.total else 0
        key = (view.phase, view.restarts, tenth)
        if key != self._printed:
            self._printed = key
            self.ui.console.print(f"  step {view.step}/{view.total or '?'}  {view.fields()}")

    def note(self, text: str) -> None:
        # markup=False: "[kill]" is text here, not a rich style tag.
        (self.progress.console if self.ui.live else self.ui.console).print(f"  {text}", soft_wrap=True, markup=False)

    def close(self) -> None:
        pass


class TokenPrinter:
    """Prints a generation as it arrives, token by token."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.console.print("  [bold]>[/] " if console.is_terminal else "  > ", end="")

    def token(self, text: str) -> None:
        self.console.print(text.replace("\n", "\n    "), end="", style="cyan", markup=False, highlight=False)
        self.console.file.flush()

    def end(self) -> None:
        self.console.print()
