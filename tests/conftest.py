"""Test set-up: split the CPU into 4 logical devices before TensorFlow starts (how TF and Keras test
their own distribution code), so 1-tower and N-tower runs can be compared in one process; and point
the scan cache (seg_train/data/scan_cache.py) at a folder of this session, never the user's home
(the seg-train processes the tests start inherit it)."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="seg-train-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)

from seg_train import replicas  # noqa: E402

replicas.setup_devices(4)
