"""Ahead-of-time GPU compiles of the Triton kernels without a GPU (tests/test_triton_compile.py).

`capture` runs the ops on CPU tensors with every kernel launch recorded instead of run, so the
arguments, constexprs and configs compiled are exactly those the ops pass; `aot` compiles one
recorded launch for an sm_80/sm_90 target and reads shared memory, registers and spills;
`python -m triton_compile` (from tests/) runs a variant set and writes the JSON results.
This package must run without TRITON_INTERPRET: the interpreter replaces the JIT functions.
"""
