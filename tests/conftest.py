"""Shared test settings: pytest-xdist runs one worker per core, so each worker uses one torch thread."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
