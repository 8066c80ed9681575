"""The one check that a file's tensors fill a model exactly: the same names, none left over, the same shapes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from oneblock.errors import ConversionError


def check_tensors_fill(
    expected: Mapping[str, Sequence[int]], given: Mapping[str, Sequence[int]], what: str, *, shown: int = 6
) -> None:
    """Refuse ``given`` (tensor name -> shape, from a file) unless it names exactly the tensors of ``expected``
    (name -> shape, the model built from the config), each with its shape.

    Raises:
        ConversionError: ``"cannot fill WHAT: missing [...], unexpected [...]"`` (the first ``shown`` of each), or
            the tensors whose shapes differ, file against config.
    """
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    if missing or unexpected:
        raise ConversionError(
            f"cannot fill {what}: missing {missing[:shown]}, unexpected {unexpected[:shown]}; the file and the "
            "model built from its config disagree on names"
        )
    wrong = [
        f"{name!r} has shape {tuple(given[name])} in the source but {tuple(expected[name])} in the model"
        for name in expected
        if tuple(given[name]) != tuple(expected[name])
    ]
    if wrong:
        raise ConversionError(f"cannot fill {what}: {'; '.join(wrong[:4])} built from the config")
