"""The HTTP service: `recspec serve` (FastAPI + uvicorn) over one trained target and its draft."""
