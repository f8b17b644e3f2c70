"""The commands run TensorFlow's CPU ops on its pooling BFC allocator (cli.TF_ENV_DEFAULTS), and a
user's own TF_CPU_ALLOCATOR_USE_BFC wins.

Observed from outside seg-train, through TensorFlow itself: `tf.config.experimental.get_memory_info`
answers for a BFC-allocated CPU device and raises for the default malloc-based one. Each case runs in
a fresh process (the allocator is chosen once, when TensorFlow creates the CPU device)."""

import os
import subprocess
import sys

import pytest

PROBE = """
from seg_train.cli import import_tensorflow
tf = import_tensorflow(debug=False)
x = tf.random.normal([256, 256])
_ = (x @ x).numpy()
try:
    info = tf.config.experimental.get_memory_info("CPU:0")
    print("bfc", info["peak"] > 0)
except ValueError as e:
    print("malloc", "not available" in str(e))
"""


def _probe(value):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    if value is not None:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize("value, expected", [(None, ["bfc", "True"]), ("false", ["malloc", "True"]),
                                             ("true", ["bfc", "True"])])
def test_commands_use_tensorflow_bfc_cpu_allocator_unless_told_otherwise(value, expected):
    assert _probe(value) == expected
