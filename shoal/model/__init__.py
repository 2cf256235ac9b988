"""The LLaMA-style decoder, built as pipeline stages; the tokenizer and the corpus."""
