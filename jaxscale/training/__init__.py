"""Training: config, model registry, data, the trainer, checkpoints, evaluation and ranking."""
