"""Semantic item identifiers: text embeddings, residual quantisation, collision resolution,
the item index (item <-> token sequence) and its prefix trie."""
