"""Fine-tuning pretrained models: supervised data, LoRA adapters and the ``oneblock finetune`` run."""
