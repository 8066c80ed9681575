"""What a run directory promises on resume, and the one-line refusals when it cannot keep the promise.

A run continues only on the data it trained on (``config.json`` records the text's path, length and SHA-256) and
only from a checkpoint that verifies. When none does, its steps have been moved aside to ``checkpoints/damaged``
(``oneblock.train.checkpoints``), never deleted, and the user chooses: continue from the newest weights that
verify with a fresh optimizer state, or start again elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from oneblock.errors import CheckpointError
from oneblock.io import integrity
from oneblock.train.checkpoints import DAMAGED, CheckpointDir
from oneblock.train.logbook import LOG_FILE, last_counters

CONFIG_FILE = "config.json"
"""The run's settings, written when it starts: what rebuilds its model and trainer on resume."""


def read_config(run_dir: str | Path, sections: tuple[str, ...], *, kind: str) -> dict[str, Any]:
    """The run directory's ``config.json``, checked to hold the JSON objects ``sections``.

    Raises:
        CheckpointError: the file is missing or damaged, or lacks a section (not a ``kind`` run).
    """
    path = Path(run_dir) / CONFIG_FILE
    if not path.exists():
        raise CheckpointError(f"{str(path)!r} does not exist; is {str(run_dir)!r} a oneblock {kind} run?")
    saved = integrity.load_json(path, "run config")
    missing = [name for name in sections if not isinstance(saved.get(name), dict)]
    if missing:
        raise CheckpointError(
            f"{str(path)!r} is not the config of a {kind} run: it lacks its {' and '.join(map(repr, missing))} "
            "section(s)"
        )
    return saved


def check_same_data(config_path: Path, source: dict[str, Any] | None) -> None:
    """Refuse to resume on a text other than the one the run recorded.

    Args:
        config_path: the run's ``config.json``; a run from before the record (no ``data`` entry) passes.
        source: ``oneblock.train.data.fingerprint`` of the text read now; None for a synthetic task.

    Raises:
        CheckpointError: the text's length or SHA-256 differs, naming both.
    """
    recorded = integrity.load_json(config_path, "run config").get("data") if config_path.exists() else None
    if recorded is None or source is None or recorded == source:
        return
    what = "the shipped corpus" if source["text"] is None else f"the text file {source['text']!r}"
    raise CheckpointError(
        f"{what} is not the data this run trained on: the run recorded {_describe_text(recorded)}, it now has "
        f"{source['bytes']} bytes with SHA-256 {source['sha256'][:16]}...; put the original text back, or start a "
        "new run in another run_dir"
    )


def none_verifies(checkpoints: CheckpointDir, run_dir: Path | None) -> str:
    """The refusal of a run whose every step fails its check: the files, and the user's two ways on."""
    return (
        f"no checkpoint of {str(run_dir)!r} verifies; the steps that fail their check were moved aside to "
        f"{str(checkpoints.root / DAMAGED)!r}, not deleted ({checkpoints.describe_damaged()}). Continue from the "
        "newest weights that verify, with a fresh optimizer state: resume with weights_only=True; "
        "or start the run again in a new run_dir"
    )


def no_weights_verify(checkpoints: CheckpointDir) -> str:
    """The refusal of ``--resume-weights-only`` when not even the weights of a damaged step verify."""
    return (
        f"no weights in {str(checkpoints.root / DAMAGED)!r} verify either "
        f"({checkpoints.describe_damaged(weights_only=True)}); start the run again in a new run_dir"
    )


def restore_weights(
    checkpoints: CheckpointDir, model: nn.Module, head: nn.Module | None, run_dir: Path | None
) -> tuple[int, int, float, str]:
    """Load the newest damaged step whose weights (and head) verify into ``model`` (and ``head``).

    The trainer state of that step is not used: the optimizer, the data stream and the random generators start
    over. The token and time counters come from the last log line at or before the step.

    Returns:
        ``(step, tokens, elapsed, note)``: the step the weights were saved at, the counters, and one sentence
        saying what was done.

    Raises:
        CheckpointError: no damaged step has weights that verify, naming the files.
    """
    found = checkpoints.newest_weights(head=head is not None)
    if found is None:
        raise CheckpointError(no_weights_verify(checkpoints))
    path, step = found
    checkpoints.load_weights(path, model, head=head)
    tokens, elapsed = last_counters(run_dir / LOG_FILE, step) if run_dir is not None else (0, 0.0)
    note = (
        f"continuing from the weights of step {step} in {str(path)!r}, with a fresh optimizer state; the data "
        "stream and the random generators start over, so the run will not match an uninterrupted one"
    )
    return step, tokens, elapsed, note


def _describe_text(recorded: Any) -> str:
    """``1234 bytes with SHA-256 0123456789abcdef...`` from a run's record, however it was damaged."""
    if isinstance(recorded, dict) and isinstance(recorded.get("sha256"), str):
        return f"{recorded.get('bytes')} bytes with SHA-256 {recorded['sha256'][:16]}..."
    return f"{str(recorded)[:80]!r}"
