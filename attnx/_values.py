"""Whether a tensor's values can be read here, asked by every data-dependent guard (the float64
reruns where float32 overflows, skipping an all-True padding mask): not while torch.compile
traces a graph (which keeps no data-dependent branch), nor for meta or fake tensors
(FakeTensorMode, make_fx's fake tracing), which have shapes only."""

import torch
from torch._subclasses.fake_tensor import is_fake


def values_readable(t: torch.Tensor) -> bool:
    return not (torch.compiler.is_compiling() or t.device.type == "meta" or is_fake(t))
