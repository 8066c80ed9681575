"""A rich progress bar for training: step count, loss, tokens per second and time remaining."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainProgress:
    """Shows ``train  ━━━━━━━  120/500  loss 1.2345  41.2k tok/s  0:00:31``; does nothing when disabled.

    Args:
        total: the run's total steps.
        start: steps already done (a resumed run).
        enabled: False on ranks other than 0 and with ``--quiet``.
        console: where to draw (stderr by default, so stdout stays clean for results).
    """

    def __init__(self, total: int, *, start: int = 0, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[speed]} tok/s"),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
            disable=not enabled,
        )
        self._task = self._progress.add_task("train", total=total, completed=start, loss="-", speed="-")

    def __enter__(self) -> TrainProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        speed = f"{tokens_per_s / 1000:.1f}k" if tokens_per_s >= 1000 else f"{tokens_per_s:.0f}"
        self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", speed=speed)

    def log(self, message: str) -> None:
        """Print a line above the bar."""
        if self.enabled:
            self._progress.console.print(message)
