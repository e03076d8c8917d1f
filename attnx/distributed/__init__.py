"""Context parallelism over torch.distributed: ring attention and sequence sharding.

See API.md (`attnx.distributed`). Importing this package imports torch.distributed only as a
name; nothing here touches it before a function is called.
"""

from .layout import shard, unshard
from .ring import ring_attention

__all__ = ["ring_attention", "shard", "unshard"]
