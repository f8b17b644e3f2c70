"""data.root checked before TensorFlow starts: a folder of the layout, or where the synthetic demo set is (or
can be) generated. Nothing here imports TensorFlow or writes anything."""

from __future__ import annotations

from pathlib import Path

from seg_train.config import Config, ConfigError, is_url
from seg_train.util.paths import check_creatable_dir


def check_synthetic_data(cfg: Config) -> None:
    """With data.synthetic, the demo data set is either complete at data.root or can be generated there."""
    from seg_train.data.synthetic import COMPLETE_MARKER

    if cfg.data.synthetic and is_url(cfg.data.root):
        raise ConfigError("synthetic data on a URL", "data.root", f"a local folder for data.synthetic: true "
                          f"(the demo set is written with local file operations), got {cfg.data.root!r}")
    root = Path(cfg.data.root)
    if not cfg.data.synthetic or (root / COMPLETE_MARKER).is_file():
        return
    if root.is_dir() and any(root.iterdir()):
        raise ConfigError("not the synthetic data set", f"data.root: {root}",
                          f"an empty or new folder for data.synthetic: true (this one has files but no "
                          f"{COMPLETE_MARKER}; never overwritten), or data.synthetic: false for your own data")
    check_creatable_dir(root, "synthetic data folder", "set data.root to a folder you can write to")


def check_data_root(cfg: Config) -> None:
    """data.root is a folder (or the synthetic data set can be generated there)."""
    if cfg.data.synthetic:
        check_synthetic_data(cfg)
        return
    if is_url(cfg.data.root):
        return  # only TensorFlow's file systems can look: the reader checks it (layouts.list_samples)
    root = Path(cfg.data.root)
    if not root.is_dir():
        raise ConfigError("data root not found", "data.root",
                          f"expected a {cfg.data.layout}-layout folder, got {str(root)!r}")
