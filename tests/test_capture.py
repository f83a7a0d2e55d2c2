"""``capture``: the cached hooks and logits agree with ``run_with_cache`` and ``model(tokens)``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lensdiv.data.tokenizer import BOS_ID
from lensdiv.ops.capture import capture


def _names(model: Any) -> list[str]:
    names = ["blocks.0.hook_resid_pre"]
    for layer in range(model.cfg.n_layers):
        names += [f"blocks.{layer}.hook_attn_out", f"blocks.{layer}.hook_mlp_out",
                  f"blocks.{layer}.hook_resid_post"]
    return names


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    toks = torch.randint(4, 260, (2, 10), generator=gen)
    toks[:, 0] = BOS_ID
    return toks


@contextlib.contextmanager
def _count_hook_calls(model: Any) -> Iterator[dict[int, int]]:
    """Count calls per hook point of every hook ``capture`` attaches (keyed by hook point id)."""
    calls: dict[int, int] = {}
    original = model.hooks

    def counting(fwd_hooks: list = [], *args: Any, **kwargs: Any) -> Any:  # noqa: B006
        wrapped = []
        for name, fn in fwd_hooks:
            key = id(model.hook_dict[name])

            def hook(tensor: torch.Tensor, *, hook: Any, _fn: Any = fn, _key: int = key) -> Any:
                calls[_key] = calls.get(_key, 0) + 1
                return _fn(tensor, hook=hook)

            wrapped.append((name, hook))
        return original(*args, fwd_hooks=wrapped, **kwargs)

    model.hooks = counting
    try:
        yield calls
    finally:
        del model.hooks  # back to the class's method


def test_capture_matches_run_with_cache(tiny_model: Any, tokens: torch.Tensor) -> None:
    names = _names(tiny_model)
    logits, store = capture(tiny_model, tokens, names, need_logits=False)
    assert logits is None
    with torch.no_grad():
        ref_logits, cache = tiny_model.run_with_cache(tokens, names_filter=names)
    assert set(store) == set(names)
    for name in names:
        assert not store[name].requires_grad
        torch.testing.assert_close(store[name], cache[name], atol=1e-6, rtol=0)
    logits, store2 = capture(tiny_model, tokens, names, need_logits=True)
    with torch.no_grad():
        direct = tiny_model(tokens)
    torch.testing.assert_close(logits, direct, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=0)
    for name in names:
        torch.testing.assert_close(store2[name], store[name], atol=1e-6, rtol=0)


def test_capture_alias_fires_once(tiny_model: Any, tokens: torch.Tensor) -> None:
    pairs = [("blocks.0.hook_resid_pre", "blocks.0.hook_in"),
             ("blocks.0.hook_resid_post", "blocks.0.hook_out")]
    for alias, canonical in pairs:
        assert tiny_model.hook_dict[alias] is tiny_model.hook_dict[canonical]
    names = [n for pair in pairs for n in pair] + ["blocks.0.hook_resid_pre"]  # and a repeat
    with _count_hook_calls(tiny_model) as calls:
        _, store = capture(tiny_model, tokens, names, need_logits=False)
    assert "hooks" not in vars(tiny_model)
    for alias, canonical in pairs:
        assert calls[id(tiny_model.hook_dict[alias])] == 1
        assert store[alias] is store[canonical]
    with torch.no_grad():
        _, cache = tiny_model.run_with_cache(tokens, names_filter=[p[0] for p in pairs])
    for alias, _ in pairs:
        torch.testing.assert_close(store[alias], cache[alias], atol=1e-6, rtol=0)


def test_capture_with_grad(tiny_model: Any, tokens: torch.Tensor) -> None:
    name = "blocks.0.hook_resid_post"
    logits, store = capture(tiny_model, tokens, [name], need_logits=True, grad=True)
    assert store[name].requires_grad and logits is not None and logits.requires_grad
    (grad,) = torch.autograd.grad(logits[:, -1].logsumexp(-1).sum(), store[name])
    assert grad.shape == store[name].shape and grad[:, -1].abs().sum() > 0
    assert torch.is_grad_enabled()  # capture restored the global grad mode
