"""The research experiments behind BENCHMARKS.md, one module each, run as ``python -m benchmarks.lab
COMMAND`` (:mod:`benchmarks.lab.cli`) from the repository's root. They use recspec's public modules
and its shared result writer (:mod:`recspec.bench.report`); recspec never imports them."""
