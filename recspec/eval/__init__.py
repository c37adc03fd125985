"""Ranking metrics (Recall@K, NDCG@K) over generated top-K lists."""
