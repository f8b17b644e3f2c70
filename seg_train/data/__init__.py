"""Files to batches. The front door is data/split.py: `open_split` opens a split of the configured data
and `train_dataset_fn` deals its training stream to the towers; every command reads its data through
them. Imports nothing from training or inference.

This file imports nothing, so any module can be imported alone (feed.py and labels.py before
TensorFlow starts).
"""
