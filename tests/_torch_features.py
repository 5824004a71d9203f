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


# (torch 2.7 added float8_e8m0fnu: older torch cannot name it in a parametrization)
E8M0 = getattr(torch, "float8_e8m0fnu", None)
NO_E8M0 = "this torch has no float8_e8m0fnu (torch 2.7 has it)"


def _float8_kernel(op) -> bool:
    """Whether this torch's CPU kernel for ``op`` takes a float8_e4m3fnuz tensor: torch 2.4
    has no float8 indexing (``index_cpu``) or fill (``fill_cpu``) there."""
    x = torch.zeros(2, dtype=torch.uint8).view(torch.float8_e4m3fnuz)
    try:
        op(x)
    except (NotImplementedError, RuntimeError):
        return False
    return True


needs_float8_index = pytest.mark.skipif(
    not _float8_kernel(lambda x: x[torch.tensor([1])]),
    reason="this torch has no CPU index kernel for float8 (a loader cannot index one)")
needs_float8_fill = pytest.mark.skipif(
    not _float8_kernel(lambda x: x.fill_(0)),
    reason="this torch has no CPU fill kernel for float8 (a loader cannot fill one)")
needs_foreach_clone = pytest.mark.skipif(
    not hasattr(torch, "_foreach_clone"), reason="this torch has no torch._foreach_clone")


# (whether nn.Module keeps its parameters, buffers and children in plain dicts, as torch
# 2.13 does; torch 2.4 keeps them in OrderedDicts, which RuntimeIndex's columns decline)
MODULES_KEEP_DICTS = type(torch.nn.Module()._parameters) is dict
