import os
import sys

import torch

# The Triton kernels are tested on every machine: through Triton's interpreter when there is no
# GPU. It must be switched on before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test helpers (golden.py, _compare.py) are imported by their plain names.
sys.path.insert(0, os.path.dirname(__file__))
