"""Test set-up: split the CPU into 4 logical devices before TensorFlow starts (how TF and Keras test
their own distribution code), so 1-tower and N-tower runs can be compared in one process."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from seg_train import replicas  # noqa: E402

replicas.setup_devices(4)
