"""The commands run TensorFlow's CPU ops on its pooling BFC allocator (cli.TF_ENV_DEFAULTS), and a
user's own TF_CPU_ALLOCATOR_USE_BFC wins.

Observed from outside seg-train, through TensorFlow itself: its BFC allocator logs the name of every
pool it creates (VLOG 1 of bfc_allocator.cc), and the pool TF_CPU_ALLOCATOR_USE_BFC asks for is the one
named `bfc_cpu_allocator_for_gpu` (TensorFlow shares its GPU build's host allocator). Each case runs in a
fresh process (the allocator is chosen once, when TensorFlow creates the CPU device).

Why not `tf.config.experimental.get_memory_info("CPU:0")` (the probe this test used first): it answers for
any BFC-backed CPU allocator, and where oneDNN is on (AVX-512 machines) TensorFlow's default CPU allocator
without the variable is oneDNN's own BFC pool ("mklcpu"), so it answered in every case there.
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

PROBE = """
from seg_train.cli import import_tensorflow
tf = import_tensorflow(debug=True)  # debug: TensorFlow's own log lines stay on stderr
x = tf.random.normal([256, 256])
_ = (x @ x).numpy()
"""
POOL = "Creating new BFCAllocator named: bfc_cpu_allocator_for_gpu"


def _uses_bfc(value):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="bfc_allocator=1")
    if value is not None:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return POOL in out.stderr


# The two True cases also show that the probe sees TensorFlow's log lines (else "false" would pass blind).
@pytest.mark.parametrize("value, expected", [(None, True), ("false", False), ("true", True)])
def test_commands_use_tensorflow_bfc_cpu_allocator_unless_told_otherwise(value, expected):
    assert _uses_bfc(value) == expected
