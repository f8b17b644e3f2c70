"""Training: the run read top to bottom (train.py), the step loop (loop.py) and the one-graph train
step (step.py) over the towers' pass (towers.py) and the update (update.py)."""
