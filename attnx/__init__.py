"""attnx: fused attention kernels for PyTorch (scaled dot-product and additive attention)."""

from ._version import __version__
from . import _ops  # noqa: F401  (registers fake kernels and autograd for the native ops)
from . import distributed  # noqa: F401  (touches torch.distributed only when called)
from . import hf  # noqa: F401  (imports transformers only when hf.register() is called)
from ._dispatch import (BackendStatus, BackendUnavailableError, additive_attention, backends,
                        scaled_dot_product_attention)
from ._dispatch import attention_with_kvcache, varlen_attention

__all__ = ["__version__", "scaled_dot_product_attention", "additive_attention",
           "attention_with_kvcache", "varlen_attention", "backends",
           "BackendStatus", "BackendUnavailableError"]
