"""The planner: what a layout costs before anything runs.

- `memory`: model-state bytes per rank (parameters, gradients, optimizer state) for
  every layout, and the ZeRO paper's mixed-precision model.
- `activations`: activation bytes per rank (Korthikanti et al. 2022).
- `comm`: bytes a rank sends per step, counted as `strategies.comm_count` counts them.
- `layouts`: the candidate layouts for N devices.
- `plan`: each candidate's memory, bytes and modelled step time; the recommendation.
- `command`: `trainstack plan SPEC`.

Pure arithmetic on counts: nothing here imports Ray or touches a device.
"""
