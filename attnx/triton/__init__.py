"""Triton kernels for attnx, registered as torch custom ops (`torch.ops.attnx.triton_*`).

Importing this package imports Triton and registers the ops; `attnx.backends.triton_backend`
does so lazily, on the first call that runs here. Under Triton's interpreter
(`TRITON_INTERPRET=1`, set before Triton is imported) the same kernels run on CPU tensors.
"""

from . import additive, sdpa  # noqa: F401  (registers the ops)
