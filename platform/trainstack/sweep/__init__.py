"""Tune sweeps over job-spec keys: `trainstack sweep tune/<sweep>.yaml`."""
