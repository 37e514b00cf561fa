"""The RL and SFT training loop: train state, jitted step functions, the outer loop and its checkpoints."""
