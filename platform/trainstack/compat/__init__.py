"""Where trainstack meets the versions of the libraries a user brings.

- `ray_private`: every use of a Ray name outside Ray's public API, each behind a feature
  check with a fallback for the Ray versions that lack it.
- `torch_private`: the same for torch.

Nothing here is imported at module import time by the rest of the package unless it
is needed; no private name is imported when this package is.
"""
