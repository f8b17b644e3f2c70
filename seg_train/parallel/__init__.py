"""Across devices and machines: the tf.distribute strategy and its devices (replicas.py), the in-graph
cross-tower arithmetic, all-reduces and gradient packing (collectives.py), and the tower pass traced once for
every tower (towers.py)."""
