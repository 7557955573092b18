"""The per-worker training loop and the launchers that run it (Ray Train, plain processes)."""
