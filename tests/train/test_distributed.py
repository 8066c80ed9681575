"""Data parallelism: two gloo processes on the CPU, each with half the batch, take the same step as one process
with the whole batch (DDP averages the gradients; with equal shards that is the full-batch gradient)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from oneblock.train import distributed

WORKER = Path(__file__).with_name("ddp_worker.py")
BATCH = 3  # per process; the single process takes 2 * BATCH
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ddp(out: Path) -> None:
    """Start two processes the way torchrun would: the same script, each with its own RANK."""
    port = str(_free_port())
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS} | {"OMP_NUM_THREADS": "1"}
    launch = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out), str(BATCH)],
            env=base | launch | {"RANK": str(r), "LOCAL_RANK": str(r)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    errors = []
    for p in procs:
        _, err = p.communicate(timeout=180)
        if p.returncode != 0:
            errors.append(err[-2000:])
    assert not errors, "\n".join(errors)


def _single_process_step() -> tuple[dict[str, torch.Tensor], float]:
    spec = importlib.util.spec_from_file_location("ddp_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    weights, loss, world = worker.one_step(2 * BATCH)
    assert world == 1
    return weights, loss


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_one_ddp_step_equals_one_full_batch_step(tmp_path, monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "ddp.safetensors"
    _run_ddp(out)
    ddp = load_file(str(out))
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    single, loss = _single_process_step()
    assert meta["world"] == "2"
    assert float(meta["loss"]) == pytest.approx(loss, abs=1e-6)  # the loss averaged over ranks
    assert ddp.keys() == single.keys()
    trained = [k for k in single if not k.startswith("initial.")]
    moved = [k for k in trained if not torch.equal(single[k], single[f"initial.{k}"])]
    assert len(moved) > len(trained) // 2  # the step changed the weights, so equality below means something
    for key in single:
        torch.testing.assert_close(ddp[key], single[key], atol=1e-6, rtol=0, msg=lambda m, k=key: f"{k}: {m}")


def test_shard_gives_each_rank_its_equal_slice():
    batch = {"tokens": torch.arange(12).view(6, 2)}  # (6, 2)
    parts = [distributed.shard(batch, distributed.Context(rank=r, world=3))["tokens"] for r in range(3)]
    assert torch.equal(torch.cat(parts), batch["tokens"])
    assert [p[:, 0].tolist() for p in parts] == [[0, 2], [4, 6], [8, 10]]


def test_single_process_context(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    ctx = distributed.setup("cpu")
    assert (ctx.rank, ctx.world, ctx.is_main, ctx.distributed) == (0, 1, True, False)
    module = torch.nn.Linear(2, 2)
    assert distributed.wrap(module, ctx) is module
    assert distributed.gather({"a": 1}, ctx) == [{"a": 1}]
    assert distributed.mean(2.5, ctx) == 2.5
