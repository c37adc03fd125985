"""Models: Hugging Face causal LMs, their tokenizers and presets."""
