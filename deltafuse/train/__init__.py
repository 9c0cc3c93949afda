"""`deltafuse train`: fine-tuning with padding-free packing on transformers' Trainer (see trainer.py)."""

from deltafuse.train.errors import TrainInputError

__all__ = ["TrainInputError"]
