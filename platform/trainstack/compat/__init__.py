"""Where trainstack meets the versions of the libraries a user brings.

- `ray`: every use of a Ray name outside Ray's public API, each behind a feature
  check with a fallback for the Ray versions that lack it.
- `torch`: the same for torch.

Nothing here is imported at module import time by the rest of the package unless it
is needed; no private name is imported when this package is. Import them under a name
of their own (`from trainstack.compat import torch as torch_compat`) so that they never
shadow the library they stand beside.
"""
