"""``python -m benchmarks.lab COMMAND ...``: the lab's command line (:mod:`benchmarks.lab.cli`)."""

from benchmarks.lab.cli import main

main()
