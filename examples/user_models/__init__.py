"""An ML engineer's own model package, as trainstack jobs name it by import path.

- `cnn`: a small CNN for `task.kind: classify` (`user_models.cnn:build`), and `Flat`,
  a classifier with its own `forward()` and no `pipeline_layers()`.
- `transformer`: a causal transformer language model for `task.kind: lm`
  (`user_models.transformer:TinyTransformer`) with `pipeline_layers()` and
  `flops_per_token()`.
- `losses`: a user loss for `task.loss` (`user_models.losses:label_smoothed_ce`).

Nothing here imports trainstack: a model is a plain `nn.Module`.
"""
