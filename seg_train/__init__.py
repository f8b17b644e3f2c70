"""seg-train: semantic segmentation training on several GPUs with TensorFlow 2."""

__version__ = "0.1.0"
