"""gpuwatch: a per-node GPU health daemon for PyTorch training fleets."""

__version__ = "0.1.0"
