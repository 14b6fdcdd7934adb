"""The embedded default policy: a character tokenizer and tiny Llama/Qwen2 models (no downloads)."""
