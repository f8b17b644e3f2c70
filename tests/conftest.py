"""Test set-up: split the CPU into 4 logical devices before TensorFlow starts (how TF and Keras test
their own distribution code), so 1-tower and N-tower runs can be compared in one process; the CPU
allocator the commands use (cli.TF_ENV_DEFAULTS), so the in-process tests run as the commands do; and
point the scan cache (seg_train/data/scan_cache.py) at a folder of this session, never the user's
home (the seg-train processes the tests start inherit it). `demo_root`: a small synthetic data set, one per
test module that asks for it. `tiny_vits16`: tests/helpers.py's TINY_VITS16 in dinov3_vits16's place in the
variant table, for the module that asks for it (the in-process runs build from config files, which read the
table; a process the tests start builds the real one)."""

import atexit
import os
import shutil
import tempfile

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from seg_train.cli import set_tf_env_defaults  # noqa: E402

set_tf_env_defaults()
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="seg-train-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)

from seg_train.parallel import replicas  # noqa: E402

replicas.setup_devices(4)

from tests.helpers import TINY_VITS16, make_ade20k_tree, make_cityscapes_tree, make_pairs_tree  # noqa: E402

# The modules that take a minute or more on two cores, heaviest first. `make test` runs whole modules on two
# processes (--dist loadfile) in collection order, so a heavy module collected last (the alphabet's order) would
# run alone at the end while the other process idles; collected first, the light ones fill in around them.
HEAVY_FIRST = ("test_panoptic_model.py", "test_eomt_train.py", "test_recompute.py", "test_multiworker.py",
               "test_bench.py", "test_layouts.py", "test_robustness.py", "test_gradients.py",
               "test_train_cli.py", "test_segformer.py", "test_mixed_precision.py", "test_step_reference.py",
               "test_verify_towers.py", "test_transformers_weights.py", "test_eomt_run_length.py",
               "test_tensorboard.py", "test_onnx.py", "test_config_wiring.py", "test_vit_wiring.py")


def pytest_collection_modifyitems(session, config, items):
    """HEAVY_FIRST's modules first; the sort is stable, so each module's tests and the others keep their order."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    """The demo data set (data/synthetic.py) of 12 train and 4 val images of 40x48, 3 classes."""
    from seg_train.data import synthetic

    return synthetic.generate(tmp_path_factory.mktemp("data") / "demo", num_train=12, num_val=4, size=(40, 48),
                              num_classes=3)


@pytest.fixture(scope="session")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("layouts")
    rng = np.random.default_rng(0)
    make_cityscapes_tree(base / "cityscapes", rng)
    make_ade20k_tree(base / "ADEChallengeData2016", rng)
    make_pairs_tree(base / "pairs", rng)
    return {"cityscapes": base / "cityscapes", "ade20k": base / "ADEChallengeData2016", "pairs": base / "pairs"}


@pytest.fixture(scope="module")
def tiny_vits16():
    """TINY_VITS16 as dinov3_vits16 from the first test of the module that asks for it to the module's end (a
    module fixture's runs are read back under the same table by the module's tests); so a module that uses it
    asks for it in every test (pytestmark), and none of its tests depends on which ran first."""
    from seg_train.config.variants import VIT_VARIANTS

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(VIT_VARIANTS, "dinov3_vits16", TINY_VITS16)
        yield TINY_VITS16
