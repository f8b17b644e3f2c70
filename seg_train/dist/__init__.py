"""Across devices and machines: the tf.distribute strategy and its devices (replicas.py) and the in-graph
cross-tower arithmetic, all-reduces and gradient packing (collectives.py)."""
