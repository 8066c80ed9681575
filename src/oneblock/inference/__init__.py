"""Running a trained model: loading, tokenizers, sampling, generation, chat, embeddings and int8 weights."""
