"""Triton kernels for attnx, registered as torch custom ops (`torch.ops.attnx.triton_*`).

Importing `attnx.triton.sdpa` / `attnx.triton.additive` imports Triton and registers their ops;
`attnx._backends.triton_backend` does so lazily, on the first call that runs here. Under
Triton's interpreter (`TRITON_INTERPRET=1`, set before Triton is imported) the same kernels
run on CPU tensors.
"""
