"""Whether ``compile=True`` compiles the per-token decoding step, and why not when it does not.

Decoding one token is a few hundred small operations on a batch of one: there is little for a compiler to fuse,
and the step's time is the weights' reading. Measured on 2-core x86 CPUs (an AVX2 AMD EPYC and an AVX-512 Intel
Xeon), ``torch.compile``'s inductor step decoded SmolLM2 Q4_1 *slower* than the eager step (3.4 against ~20
tokens/s on the EPYC) after a compilation of 30 s. So on the CPU ``compile=True`` runs the eager step and says
why, once per process, on stderr. ``ONEBLOCK_COMPILE=force`` compiles anyway (to measure it on another CPU); a
backend named explicitly (``compile="aot_eager"``) is always honoured, as is ``compile=True`` on a GPU, where the
compiled step removes per-operation launch costs.
"""

from __future__ import annotations

import os
import sys

import torch

from oneblock.errors import ConfigError

ENV_COMPILE = "ONEBLOCK_COMPILE"
_CHOICES = ("auto", "force")
_said = False

REASON = (
    "oneblock: compiling the decoding step is off on the CPU: torch.compile's step measured slower than the eager "
    "one on CPUs, and compiling takes tens of seconds (set ONEBLOCK_COMPILE=force to compile anyway)"
)


def compile_backend(compile: bool | str, device: torch.device) -> str | None:
    """The ``torch.compile`` backend the decoding step should use, or ``None`` for the eager step.

    Args:
        compile: ``False``, ``True`` (inductor where it helps), or a backend's name (always honoured).
        device: where the model runs.

    Raises:
        ConfigError: ``ONEBLOCK_COMPILE`` holds something other than ``auto`` or ``force``.
    """
    if not compile:
        return None
    if isinstance(compile, str):
        return compile
    choice = os.environ.get(ENV_COMPILE, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ConfigError(f"{ENV_COMPILE} must be one of {list(_CHOICES)}; got {os.environ[ENV_COMPILE]!r}")
    if device.type != "cpu" or choice == "force":
        return "inductor"
    _say_once(REASON)
    return None


def _say_once(message: str) -> None:
    global _said
    if not _said:
        _said = True
        print(message, file=sys.stderr, flush=True)
