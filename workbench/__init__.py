"""The memory-constrained training workbench: three studies of training language models on GPUs
that are too small (see README.md)."""

# Part of every run's key: a finished run made by another version is not reused.
__version__ = "0.2.0"
