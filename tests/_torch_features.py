"""What the running torch has, for tests that need a dtype or kernel older torch lacks
(patchkit declares torch>=2.4; CI runs 2.13, and the suite was run on 2.4.1 too)."""

from __future__ import annotations

import pytest
import torch


def _copies_float4() -> bool:
    """Whether this torch copies float4_e2m1fn_x2 on the CPU: torch 2.8 and 2.9 name the
    dtype but have no copy kernel for it, older torch has no such dtype."""
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is None:
        return False
    try:
        torch.zeros(2, dtype=torch.uint8).view(fp4).copy_(
            torch.ones(2, dtype=torch.uint8).view(fp4))
    except (NotImplementedError, RuntimeError):
        return False
    return True


needs_fp4_copy = pytest.mark.skipif(
    not _copies_float4(),
    reason="this torch has no CPU copy kernel for float4_e2m1fn_x2 (torch 2.10 has one)")
