"""SIGKILL a LoRA fine-tuning run at random instants and inside every phase of a save: resuming it ends with the
adapters of a run that was never interrupted, bit for bit (adapter dropout on, so the generators matter too)."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
from finetune_testing import pair_records, tiny_llama_checkpoint, write_jsonl
from safetensors.torch import load_file

from oneblock.adapters.lora import LoraConfig
from oneblock.finetune.run import FinetuneConfig, prepare, read_run
from oneblock.train.config import TrainConfig

WRITER_OPS = ("write", "fsync", "replace", "mkdir", "unlink", "rmdir")
STEPS = 6

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _train(run_dir, ft: FinetuneConfig | None) -> None:
    """Start the run (``ft`` given) or resume it from its own config.json."""
    resume, base = ft is None, None
    if ft is None:
        ft, cfg, base = read_run(run_dir)
    else:
        cfg = TrainConfig(task="finetune", steps=STEPS, seq_len=16, batch_size=2, warmup_steps=1, save_every=1)
    prepare(ft, cfg, run_dir=run_dir, expect_base=base, device="cpu").trainer.train(resume=resume)


def _spawn(run_dir, ft: FinetuneConfig | None, *, kill_at: int | None = None, count: list | None = None) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            torch.set_num_threads(1)
            calls = [0]

            def wrap(real):
                def op(*args, **kwargs):
                    calls[0] += 1
                    if kill_at is not None and calls[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*args, **kwargs)

                return op

            for name in WRITER_OPS:
                setattr(os, name, wrap(getattr(os, name)))
            _train(run_dir, ft)
            if count is not None:
                (run_dir / "count").write_text(str(calls[0]))
            code = 0
        finally:
            os._exit(code)
    return pid


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _adapters(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{STEPS:06d}" / "trainable.safetensors"))


def test_sigkill_then_resume_gives_bit_equal_adapters(tmp_path):
    base = tiny_llama_checkpoint(tmp_path / "base.safetensors")
    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    ft = FinetuneConfig(model=str(base), data=str(data), lora=LoraConfig(rank=4, dropout=0.1))
    prepare(ft, TrainConfig(task="finetune", steps=1, seq_len=16, warmup_steps=0), run_dir=None)  # warm imports
    reference = tmp_path / "reference"
    start = time.perf_counter()
    assert _wait(_spawn(reference, ft, count=[])) == 0
    seconds = time.perf_counter() - start
    total_ops = int((reference / "count").read_text())
    expected = _adapters(reference)
    assert expected and all(".lora_" in k for k in expected)
    rng = random.Random(7)
    killed = 0
    for trial in range(6):
        run = tmp_path / f"run{trial}"
        if trial % 2:
            pid = _spawn(run, ft, kill_at=rng.randint(1, total_ops))
        else:
            pid = _spawn(run, ft)
            time.sleep(rng.uniform(0, seconds))
            os.kill(pid, signal.SIGKILL)
        killed += _wait(pid) == -signal.SIGKILL
        resume = (run / "config.json").exists()
        assert _wait(_spawn(run, None if resume else ft)) == 0, f"trial {trial}: the run did not continue"
        got = _adapters(run)
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"trial {trial}: {key} differs"
    assert killed >= 3
