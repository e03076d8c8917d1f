"""Whether a tensor's values can be read here, asked by every data-dependent guard (the float64
reruns where float32 overflows, skipping an all-True padding mask, a paged cache's block ids):
not while torch.compile traces a graph (which keeps no data-dependent branch), nor for meta or
fake tensors (FakeTensorMode, make_fx's fake tracing), which have shapes only, nor for vmap's
batched tensors (torch.func.vmap, jacfwd, jacrev: a branch on their values raises)."""

import torch
from torch._C._functorch import TransformType, is_functorch_wrapped_tensor
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch._subclasses.fake_tensor import is_fake


def under_functorch(kind: TransformType) -> bool:
    """Whether a torch.func transform of this kind (TransformType.Vmap, Jvp, Grad) encloses the
    call."""
    return (torch._C._are_functorch_transforms_active()
            and any(i.key() == kind for i in retrieve_all_functorch_interpreters()))


def values_readable(t: torch.Tensor) -> bool:
    if torch.compiler.is_compiling() or t.device.type == "meta":
        return False
    # A plain tensor that wraps no other (fake tensors are subclasses; functionalization's and
    # functorch's wrappers are what is_fake looks inside) holds values: answered without
    # is_fake, whose import and subclass checks took ~50 us of a call after a model's weights
    # had flushed the caches (105-120 vs 58-70 us, Emerald Rapids; a paged decoding step runs
    # this once per layer).
    if (type(t) is torch.Tensor and not torch._is_functional_tensor(t)
            and not is_functorch_wrapped_tensor(t)):
        return True
    return not is_fake(t) and not under_functorch(TransformType.Vmap)
