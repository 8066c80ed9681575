"""Packing and accumulation are exact rewrites of the plain computation: packed rows give each example the logits
and loss it has alone, and an accumulated step's gradients equal one big batch's."""

from __future__ import annotations

import pytest
import torch

from oneblock.finetune.batches import pack, packed_batch, pad_batch
from oneblock.finetune.objective import SupervisedObjective
from oneblock.finetune.tokenize import Example
from oneblock.models import build_model
from oneblock.presets import get_preset
from oneblock.train.config import TrainConfig
from oneblock.train.loop import Trainer

V = 53


def tiny(position: str = "rope"):
    cfg = get_preset("smollm2-135m").replace(
        vocab_size=V, d_model=36, n_heads=3, n_kv_heads=1, n_layers=2, d_ff=37, max_seq_len=64, position=position
    )
    torch.manual_seed(0)
    return build_model(cfg, dtype=torch.float64)


def examples(lengths: list[int], seed: int = 0) -> list[Example]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(lengths):
        ids = torch.randint(0, V, (n,), generator=gen).tolist()
        trained = [False, *(torch.rand(n - 1, generator=gen) < 0.6).tolist()]
        trained[-1] = True
        out.append(Example(tuple(ids), tuple(trained), f"e{k}"))
    return out


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_packed_rows_equal_examples_run_alone(position):
    model = tiny(position)
    data = examples([5, 9, 3, 7, 11, 4])
    groups = pack(data, 16)
    assert [len(g) for g in groups] == [3, 2, 1]  # inputs 4 + 8 + 2 | 6 + 10 | 3
    batch = packed_batch(groups, seq_len=16, pad_id=0)
    logits = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"])  # (B, T, V)
    for row, group in enumerate(groups):
        start = 0
        for example in group:
            alone = pad_batch([example], pad_id=0)
            n = alone["tokens"].shape[1]
            expected = model(alone["tokens"])[0]  # (n, V)
            torch.testing.assert_close(logits[row, start : start + n], expected, atol=1e-10, rtol=0)
            assert torch.equal(batch["labels"][row, start : start + n], alone["labels"][0])
            start += n


def objective(data, *, packed=False, seq_len=16):
    cfg = TrainConfig(task="finetune", seq_len=seq_len, steps=1, warmup_steps=0)
    return SupervisedObjective(cfg, data, [], vocab_size=V, pad_id=0, packed=packed)


def test_packed_loss_equals_padded_loss():
    model = tiny()
    data = examples([5, 9, 3, 7, 11, 4])
    padded = objective(data).loss_sum(model, pad_batch(data, pad_id=0))
    packed = objective(data, packed=True).loss_sum(model, packed_batch(pack(data, 16), seq_len=16, pad_id=0))
    assert padded[1] == packed[1] == sum(e.n_trained for e in data)
    torch.testing.assert_close(packed[0], padded[0], atol=1e-10, rtol=0)


def grads_after_one_step(batch_size: int, grad_accum: int) -> dict[str, torch.Tensor]:
    model = tiny().float()
    data = examples([5, 9, 3, 12])  # different numbers of trained tokens per example
    cfg = TrainConfig(
        task="finetune", seq_len=16, steps=1, warmup_steps=0, batch_size=batch_size, grad_accum=grad_accum,
        grad_clip=0.0, seed=3,
    )  # fmt: skip
    obj = SupervisedObjective(cfg, data, [], vocab_size=V, pad_id=0)
    trainer = Trainer(model.config, cfg, model=model, objective=obj, device="cpu")
    trainer.optimizer.step = lambda *a, **k: None  # keep the gradients of the step, not the update
    record = trainer.train_step()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    grads["loss"] = torch.tensor(record["loss"])
    return grads


def test_accumulation_equals_one_big_batch():
    big = grads_after_one_step(4, 1)
    accumulated = grads_after_one_step(1, 4)
    for key in big:
        torch.testing.assert_close(accumulated[key], big[key], atol=1e-6, rtol=0, msg=key)
    halves = grads_after_one_step(2, 2)
    for key in big:
        torch.testing.assert_close(halves[key], big[key], atol=1e-6, rtol=0, msg=key)


def test_segment_ids_refused_when_malformed():
    from oneblock.errors import InputError

    model = tiny()
    tokens = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(InputError, match=r"segment_ids must have shape \(B, T\) = \(2, 5\); got \(5,\)"):
        model(tokens, segment_ids=torch.zeros(5, dtype=torch.long))
    with pytest.raises(InputError, match=r"segment_ids must be an int64 tensor; got torch\.float32"):
        model(tokens, segment_ids=torch.zeros(2, 5))


def test_held_out_scores_equal_those_of_the_whole_logits():
    """``evaluate`` takes the head a tile at a time (its losses and argmax); the numbers are those of the whole
    (b, T, V) logits: the loss within float64 rounding, the accuracy exactly."""
    import torch.nn.functional as F

    model = tiny()
    held = []
    for k, example in enumerate(examples([5, 9, 3, 7, 11, 4], seed=1)):
        ids = list(example.ids)
        for j in range(1, len(ids), 2):  # every other token the model's own guess: some labels are its argmax
            with torch.no_grad():
                ids[j] = int(model(torch.tensor([ids[:j]]))[0, -1].argmax())
        held.append(Example(tuple(ids), example.trained, f"h{k}"))
    cfg = TrainConfig(task="finetune", seq_len=16, steps=1, warmup_steps=0)
    scores = SupervisedObjective(cfg, [], held, vocab_size=V, pad_id=0).evaluate(model, batch_size=4)
    total, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(held), 4):
            batch = pad_batch(held[i : i + 4], pad_id=0)
            logits, labels = model(batch["tokens"]), batch["labels"]
            chosen = labels != -100
            total += float(F.cross_entropy(logits[chosen], labels[chosen], reduction="sum"))
            correct += int((logits[chosen].argmax(-1) == labels[chosen]).sum())
            count += int(chosen.sum())
    assert 0 < correct < count  # a score that could be wrong either way
    assert scores["accuracy"] == correct / count
    assert abs(scores["loss"] - total / count) <= 1e-12
