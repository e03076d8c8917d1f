"""The benchmark suite behind `attnx bench`: providers, sweeps, timing, FLOPs, memory, reports."""

from .cli import main

__all__ = ["main"]
