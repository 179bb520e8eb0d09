"""ringctl: run ring attention jobs locally, on Slurm, or on a remote cluster over SSH."""

__version__ = "0.1.0"
