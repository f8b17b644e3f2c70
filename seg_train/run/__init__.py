"""What training and inference share, one floor below both: a run's state (the model and its companions),
its checkpoints, its run dir, the learning-rate schedule and the loss scale the state carries."""
