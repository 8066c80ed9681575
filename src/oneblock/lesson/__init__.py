"""The lesson "one block, stacked many times" as a program: each step builds the real oneblock pieces, runs
them and returns the figures it measured, so nothing in the walk-through is a typed-in number.

>>> figures = run_lesson(seed=0)
>>> figures["parameters"]["total"]["measured"]
172288

Steps, in the lesson's order: ``gelu``, ``feedforward``, ``residual``, ``layernorm``, ``assembly``,
``parameters``, ``architectures``, ``tiny``.
"""

from oneblock.lesson.run import STEPS, run_lesson

__all__ = ["STEPS", "run_lesson"]
