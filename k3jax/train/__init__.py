"""Training: mesh, stages and schedules, optimizer, train state and step, checkpoints, metrics, evaluation."""
