"""The final norm's kinds (``lensdiv.ops.norms``): one object per kind, shared by the readout
and the members. Each decomposed kind equals torch's own norm, and folding a fixed ``σ(h)`` into
members that sum to ``h`` gives the norm's output less ``β`` (what the members' logits rely on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lensdiv.core.errors import HookError
from lensdiv.ops.norms import (
    FINAL_NORMS,
    LayerNorm,
    ModuleNorm,
    NoNorm,
    RMSNorm,
    declared_norm,
)

D = 16


def params() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(D, generator=gen, dtype=torch.float64) + 1.0
    bias = torch.randn(D, generator=gen, dtype=torch.float64)
    h = torch.randn(5, D, generator=gen, dtype=torch.float64) * 3 + 0.5
    return weight, bias, h


def reference(kind: str, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if kind == "LN":
        return F.layer_norm(h, (D,), weight, bias, 1e-5)
    if kind == "RMS":
        return h / (h.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * weight + bias
    return h


def test_the_registry_names_every_kind() -> None:
    assert {"LN": LayerNorm, "RMS": RMSNorm, "none": NoNorm, "module": ModuleNorm} == FINAL_NORMS
    assert [cls for cls in FINAL_NORMS.values() if not cls.decomposed] == [ModuleNorm]
    for declared, cls in (("LN", LayerNorm), ("LNPre", LayerNorm), ("RMS", RMSNorm),
                          ("RMSPre", RMSNorm), (None, None), ("other", None)):
        assert declared_norm(declared) is cls


@pytest.mark.parametrize("kind", ["LN", "RMS", "none"])
@pytest.mark.parametrize("grad", [False, True])
def test_apply_equals_the_norm_and_fold_adds_up_to_it(kind: str, grad: bool) -> None:
    weight, bias, h = params()
    if kind == "none":
        weight, bias = torch.ones(D, dtype=torch.float64), torch.zeros(D, dtype=torch.float64)
    norm = FINAL_NORMS[kind](weight, bias, 1e-5 if kind != "none" else 0.0)
    x = h.clone().requires_grad_(grad)
    got = norm.apply(x, dtype=torch.float64, device=x.device)
    torch.testing.assert_close(got, reference(kind, h, weight, bias), rtol=1e-12, atol=1e-12)
    assert torch.equal(x.detach(), h)  # the input is never modified
    # Members summing to h, each folded through sigma(h): their sum is the norm's output less beta.
    members = torch.randn(3, *h.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    members[-1] = h - members[:-1].sum(0)
    folded = norm.fold(members.clone(), norm.scale(h))
    torch.testing.assert_close(folded.sum(0) + bias, reference(kind, h, weight, bias),
                               rtol=1e-12, atol=1e-12)


def test_a_module_norm_runs_the_module_and_cannot_be_folded() -> None:
    weight, bias, h = params()
    module = torch.nn.LayerNorm(D, eps=0.3).to(torch.float32)
    norm = ModuleNorm(weight, bias, 1e-5, module=module, model_dtype=torch.float32)
    got = norm.apply(h, dtype=torch.float64, device=h.device)
    with torch.no_grad():
        want = module(h.float()).double()
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert torch.equal(norm.scale(h), torch.ones(5, dtype=torch.float64))
    with pytest.raises(HookError, match="cannot be folded"):
        norm.fold(h[None].clone(), norm.scale(h))
