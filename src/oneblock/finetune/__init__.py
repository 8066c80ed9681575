"""Fine-tuning: low-rank adapters (``lora``, ``targets``) and the training on top of them."""
