"""Validation stage: the data gate between the corpus and training."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
