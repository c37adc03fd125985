"""The repository's benchmarks: the research experiments (:mod:`benchmarks.lab`) and their results
(``benchmarks/results/``). Not part of the installed package (pyproject installs ``recspec*`` only)."""
