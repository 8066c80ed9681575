"""Training: a byte-level decoder or masked encoder on text, an encoder classifier and encoder-decoder models on
synthetic tasks, with AdamW, warmup + cosine, checkpoints with exact resume, and data parallelism under torchrun.

Nothing here imports matplotlib; ``oneblock.train.plot`` and the experiments' reports do, when they draw.
"""

from oneblock.train.config import TrainConfig
from oneblock.train.logbook import read_log
from oneblock.train.loop import Trainer, TrainResult, fit_model_config
from oneblock.train.objectives import greedy_decode, make_objective

__all__ = ["TrainConfig", "TrainResult", "Trainer", "fit_model_config", "greedy_decode", "make_objective", "read_log"]
