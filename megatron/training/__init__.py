"""Training: the loop and what it steps (learning-rate schedule, checkpoints)."""
