"""Many-to-English multilingual Transformer translation, trained with GPipe."""
