"""Data: the built-in synthetic corpus and byte tokenizer, user data sources, packing, task files."""
