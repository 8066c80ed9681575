"""FSDP2 on the CPU: two gloo processes, each holding half of every parameter and half the batch, take the same
fine-tuning step as one process with the whole batch; their checkpoint is an ordinary one that one process loads,
and a run resumed from it under FSDP continues as an uninterrupted single-process run. With the blocks'
activations checkpointed (each block gathered again for its recomputation), full or LoRA, the step is the same."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from finetune_testing import pair_records, tiny_llama_checkpoint, write_jsonl
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("fsdp_worker.py")
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str) -> None:
    """Two processes the way torchrun starts them: the same script, each with its own RANK."""
    port = str(_free_port())
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS} | {"OMP_NUM_THREADS": "1"}
    launch = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            env=base | launch | {"RANK": str(r), "LOCAL_RANK": str(r)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    errors = [err[-3000:] for p in procs for _, err in [p.communicate(timeout=300)] if p.returncode != 0]
    assert not errors, "\n".join(errors)


def _worker():
    spec = importlib.util.spec_from_file_location("fsdp_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step:06d}" / "trainable.safetensors"))


def test_fsdp_step_equals_single_process_step_and_resumes(tmp_path):
    base = str(tiny_llama_checkpoint(tmp_path / "base.safetensors"))
    data = str(write_jsonl(tmp_path / "d.jsonl", pair_records()))
    single = tmp_path / "single"
    assert _worker().train(str(single), base, data, 4, 2) == 1
    sharded = tmp_path / "sharded"
    _torchrun(str(sharded), base, data, "2", "2", "stop1")
    expected, got = _weights(single, 1), _weights(sharded, 1)
    assert got.keys() == expected.keys() and len(got) > 10
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=0, msg=key)
    from oneblock.train.state import load_state

    state = load_state(sharded / "checkpoints" / "step-000001" / "trainer.safetensors")
    assert set(state["optimizer"]["state"]) == set(expected)  # the moments of every parameter, by name
    # The second step, resumed from the sharded checkpoint under FSDP, equals the single process's second step.
    assert not (sharded / "checkpoints" / "step-000002").exists()
    _torchrun(str(sharded), base, data, "2", "2", "resume")
    expected, got = _weights(single, 2), _weights(sharded, 2)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=0, msg=key)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fsdp_with_checkpointed_activations_takes_the_single_process_step(tmp_path, method):
    base = str(tiny_llama_checkpoint(tmp_path / "base.safetensors"))
    data = str(write_jsonl(tmp_path / "d.jsonl", pair_records()))
    single = tmp_path / "single"
    assert _worker().train(str(single), base, data, 4, 1, method=method) == 1
    sharded = tmp_path / "sharded"
    _torchrun(str(sharded), base, data, "2", "1", "-", method, "ckpt")
    expected, got = _weights(single, 1), _weights(sharded, 1)
    assert got.keys() == expected.keys() and got
    if method == "lora":
        assert all(".lora_" in key for key in got)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=0, msg=key)
