"""Synthetic tasks (exact answers, reproducible streams) and masked-token corruption."""

from __future__ import annotations

import pytest
import torch

from oneblock.errors import ConfigError
from oneblock.train import tasks
from oneblock.train.masking import IGNORE, mask_tokens


@pytest.mark.parametrize("task", tasks.SEQ2SEQ_TASKS)
def test_seq2seq_layout(task):
    batch = tasks.seq2seq_batch(task, 5, 7, 4, torch.Generator().manual_seed(0))
    src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
    assert src.shape == (5, 7) and tgt_in.shape == tgt_out.shape == (5, 8)
    assert int(src.min()) >= tasks.N_SPECIAL and int(src.max()) < tasks.N_SPECIAL + 4
    answer = {"reverse": src.flip(-1), "sort": src.sort(-1).values, "copy": src}[task]
    assert torch.equal(tgt_out[:, :-1], answer) and (tgt_out[:, -1] == tasks.EOS).all()
    assert torch.equal(tgt_in[:, 1:], answer) and (tgt_in[:, 0] == tasks.BOS).all()


def test_majority_labels_are_unambiguous():
    batch = tasks.majority_batch(64, 9, 3, torch.Generator().manual_seed(0))
    tokens, labels = batch["tokens"], batch["labels"]
    assert tokens.shape == (64, 10) and (tokens[:, 0] == tasks.CLS).all()
    counts = torch.nn.functional.one_hot(tokens[:, 1:] - 1, 3).sum(1)  # (64, 3)
    top = counts.topk(2, dim=-1).values
    assert (top[:, 0] > top[:, 1]).all() and torch.equal(counts.argmax(-1), labels)


def test_stream_resumes_from_its_generator_state():
    stream = tasks.SyntheticStream("sort", length=5, n_symbols=6, seed=1)
    stream.next(3)
    state = stream.state_dict()
    ahead = stream.next(4)
    other = tasks.SyntheticStream("sort", length=5, n_symbols=6, seed=99)
    other.load_state_dict(state)
    assert torch.equal(other.next(4)["src"], ahead["src"])
    with pytest.raises(ConfigError, match="unknown synthetic task 'shuffle'"):
        tasks.SyntheticStream("shuffle", length=5, n_symbols=6, seed=0)


def test_masking_follows_bert_and_labels_only_chosen_positions():
    tokens = torch.randint(0, 50, (64, 40), generator=torch.Generator().manual_seed(0))
    inputs, labels = mask_tokens(tokens, mask_id=50, n_real=50, prob=0.15, generator=torch.Generator().manual_seed(1))
    chosen = labels != IGNORE
    assert torch.equal(labels[chosen], tokens[chosen]) and chosen.any(dim=1).all()
    assert torch.equal(inputs[~chosen], tokens[~chosen])  # unchosen positions are untouched
    share = chosen.float().mean().item()
    masked = (inputs[chosen] == 50).float().mean().item()
    assert 0.12 < share < 0.18 and 0.72 < masked < 0.88  # 15% chosen, 80% of them [MASK]
    rare = torch.zeros(8, 3, dtype=torch.long)
    _, rare_labels = mask_tokens(rare, mask_id=1, n_real=1, prob=1e-6, generator=torch.Generator().manual_seed(0))
    assert ((rare_labels != IGNORE).sum(1) == 1).all()  # every row gets at least one target
