"""Traced fidelity: the harness's own training step of one rank, at full size, on fake tensors in a fake
process group (`run`), with a live-bytes counter that splits the peak into blocks (`fake`).
Importing the package imports no torch: each name below loads its module on first use.
"""

from __future__ import annotations

from stratagem.launch._lazy import lazy_exports

_LAZY = {
    "TracedRole": "run", "trace_plan": "run", "trace_role": "run", "role_ranks": "run", "analytic_blocks": "run",
    "fake_world": "fake", "BlockBytes": "fake",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
