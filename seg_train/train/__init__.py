"""Training: the run read top to bottom (train.py), the step loop (loop.py), the one-graph train step
(step.py) over the towers' pass (towers.py), the update after the all-reduce (update.py), the training
state (state.py), losses and the learning-rate schedule (losses.py, schedule.py), checkpoints and the
run directory (checkpoint.py, rundir.py, init_from.py), TensorBoard summaries and their pictures
(summaries.py, plots.py), the profiler window (profiling.py) and the determinism check
(determinism.py)."""
