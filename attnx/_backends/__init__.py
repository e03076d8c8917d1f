"""Backends: each module states what it can serve (`availability`, `unsupported`) and runs it
(`sdpa`, `additive`). Choosing among them happens in one place, `attnx._dispatch`."""
