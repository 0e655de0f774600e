"""Training drafters aligned to a target (Goel et al. 2024): data, losses and the training loop."""
