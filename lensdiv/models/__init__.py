"""Models: loading hub names, local Hugging Face folders and bridges; the built-in toy zoo."""
