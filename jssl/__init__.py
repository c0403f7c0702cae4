"""jssl: self-supervised visual representation learning in JAX/Flax (a VISSL reimplementation)."""

__version__ = "0.1.0"
