"""The patchscope's continuations through Hugging Face's own layers (``ops/purelayers``) and
the attention over a prefix shared by every row (``ops/kvcache``): the attention against a
float64 loop over rows, heads and keys (GQA, several own tokens, masks of both kinds,
soft-capping); the pure copies against the model they came from (same weights, the model and
its config untouched); every family's continuations against the exact re-run of the whole
prompt; and each tier's fall back — to the prefix copied per row, then to the bridge."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from lensdiv.core.analyzer import ModelInfo
from lensdiv.ops.blocklens import DEFAULT_PROMPT
from lensdiv.ops.capture import capture
from lensdiv.ops.inspection import Inspection
from lensdiv.ops.kvcache import (
    SHARED_PREFIX,
    SHARED_PREFIX_FLOAT32,
    FallbackWarning,
    shared_layer,
    shared_prefix,
    shared_prefix_attention,
)
from lensdiv.ops.purelayers import pure_layer, pure_layers
from lensdiv.testing.models import boot_tiny, save_softcapped_model, save_tiny_model

ARCHS = ("gpt2", "llama", "neox", "gemma2")


@pytest.fixture(scope="module")
def models64(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """GPT-2, Llama (GQA, RoPE), NeoX (parallel) and Gemma-2 (soft-capped) in float64."""
    from transformer_lens.model_bridge import TransformerBridge

    root = tmp_path_factory.mktemp("purelayers")
    out = {a: boot_tiny(a, save_tiny_model(a, root / a)) for a in ARCHS[:3]}
    out["gemma2"] = TransformerBridge.boot_transformers(
        str(save_softcapped_model(root / "gemma2")), device="cpu", dtype=torch.float32
    ).eval()
    return {a: m.to(torch.float64) for a, m in out.items()}


def loop_attention(
    q: Any, k: Any, v: Any, kp: Any, vp: Any, mask: Any, scale: float, softcap: float | None
) -> torch.Tensor:
    """Row by row, head by head, key by key, in float64: the keys are the prefix then the
    row's own; ``mask[r, i, key]`` additive (``-inf``: not attended)."""
    n, heads, t, _ = q.shape
    g = heads // k.shape[1]
    out = torch.zeros(n, t, heads, q.shape[-1], dtype=torch.float64)
    for r in range(n):
        for h in range(heads):
            keys = torch.cat([kp[0, h // g], k[r, h // g]]).double()
            values = torch.cat([vp[0, h // g], v[r, h // g]]).double()
            for i in range(t):
                s = [float(q[r, h, i].double() @ key) * scale for key in keys]
                if softcap is not None:
                    s = [softcap * math.tanh(x / softcap) for x in s]
                s = torch.tensor(s, dtype=torch.float64) + mask[r, i].double()
                out[r, i, h] = torch.softmax(s, -1) @ values
    return out


class _Module:
    layer_idx = 0


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("own", [1, 4])
@pytest.mark.parametrize("mask_kind", ["none", "float", "float_heads", "bool"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_shared_prefix_attention_equals_a_loop(
    groups: int, own: int, mask_kind: str, softcap: float | None
) -> None:
    g = torch.Generator().manual_seed(0)
    n, kv, j, d = 3, 2, 5, 4
    heads = kv * groups
    q = torch.randn(n, heads, own, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(n, kv, own, d, generator=g, dtype=torch.float64) for _ in range(2))
    kp, vp = (torch.randn(1, kv, j, d, generator=g, dtype=torch.float64) for _ in range(2))
    causal = torch.zeros(n, own, j + own, dtype=torch.float64)
    causal[:, :, j:] = torch.full((own, own), float("-inf")).triu(1)
    if mask_kind.startswith("float"):  # also masks one prefix key of row 1, as padding would
        causal[1, :, 2] = float("-inf")
        mask: Any = causal[:, None].clone()
        if mask_kind == "float_heads":  # one mask per head
            mask = mask.expand(n, heads, own, j + own).clone()
    elif mask_kind == "bool":
        causal[1, :, 2] = float("-inf")
        mask = (causal == 0)[:, None]
    else:
        mask = None
    cache = type("Cache", (), {"layers": [shared_layer()(kp, vp)]})()
    with shared_prefix(cache):
        got, weights = shared_prefix_attention(
            _Module(), q, k, v, mask, scaling=0.7, softcap=softcap
        )
    assert weights is None and got.shape == (n, own, heads, d)
    want = loop_attention(q, k, v, kp, vp, causal, 0.7, softcap)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_shared_prefix_attention_refuses_what_it_does_not_do() -> None:
    kp = torch.zeros(1, 1, 5, 4)
    q, k = torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4)
    cache = type("Cache", (), {"layers": [shared_layer()(kp, kp)]})()
    with shared_prefix(cache):
        for kwargs, what in [
            ({"s_aux": torch.zeros(1)}, "sinks"),
            ({"dropout": 0.1}, "dropout"),
            ({"sliding_window": 4}, "sliding window"),
        ]:
            with pytest.raises(NotImplementedError, match=what):
                shared_prefix_attention(_Module(), q, k, k, None, **kwargs)
        shared_prefix_attention(_Module(), q, k, k, None, sliding_window=6)  # 6 keys: all seen


def test_pure_layers_share_the_weights_and_leave_the_model_alone(
    models64: dict[str, Any],
) -> None:
    model = models64["llama"]
    layer = model.blocks[0].original_component
    pure = pure_layers(model, SHARED_PREFIX)
    assert pure is not None and len(pure) == len(model.blocks)
    assert not any(hasattr(m, "original_component") for m in pure[0].modules())
    assert any(hasattr(m, "original_component") for m in layer.modules())  # still bridged
    own = {id(p) for p in pure[0].parameters()}
    assert own and own <= {id(p) for p in layer.parameters()}  # shared, not copied
    attn = pure[0].self_attn
    assert attn.config._attn_implementation == SHARED_PREFIX
    assert model.original_model.config._attn_implementation == "eager"
    assert pure_layer(torch.nn.Linear(2, 2)).__class__ is torch.nn.Linear
    with torch.no_grad():  # an edit of a weight is seen by the copy
        layer.mlp.original_component.down_proj.original_component.weight.mul_(2)
        assert torch.equal(
            pure[0].mlp.down_proj.weight,
            layer.mlp.original_component.down_proj.original_component.weight,
        )
        layer.mlp.original_component.down_proj.original_component.weight.div_(2)


def test_a_layer_under_accelerate_keeps_the_bridge(models64: dict[str, Any]) -> None:
    model = models64["gpt2"]
    mlp = model.blocks[1].original_component.mlp
    mlp._hf_hook = object()
    try:
        assert pure_layers(model) is None
    finally:
        del mlp._hf_hook
    assert pure_layers(model) is not None


def states(model: Any) -> list[torch.Tensor]:
    info = ModelInfo.from_model(model)
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    with torch.no_grad():
        _, cache = capture(model, model.to_tokens("The happy dog ran to"), names, need_logits=False)
    return [cache[name][0] for name in names]


def assert_continuations_exact(found: Inspection, model: Any) -> None:
    exact = Inspection(model, DEFAULT_PROMPT, found.position, fast=False)
    hs = states(model)
    for start in range(found.n_layers):
        want = exact.run(start, hs[start])
        got = found.run(start, hs[start])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10 * float(want.abs().max()))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("position", [-1, -3])
def test_every_family_shares_the_prefix_exactly(
    models64: dict[str, Any], arch: str, position: int
) -> None:
    model = models64[arch]
    found = Inspection(model, DEFAULT_PROMPT, position)
    assert (found.mode, found.layers) == ("cache", "shared prefix"), found.layers_reason
    assert found.describe()["layers"] == "shared prefix"
    assert found._buffers == {}  # no copy of the prefix per row is kept
    assert_continuations_exact(found, model)


def test_without_the_shared_prefix_the_layers_copy_it(
    models64: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AttentionInterface

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a test's refusal")

    shared_layer()  # registered before it is replaced
    for name in (SHARED_PREFIX, SHARED_PREFIX_FLOAT32):
        monkeypatch.setitem(AttentionInterface._global_mapping, name, refuse)
    model = models64["llama"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # a known limit: no warning
        found = Inspection(model, DEFAULT_PROMPT, -1)
    assert found.layers == "hugging face" and "a test's refusal" in found.layers_reason
    assert_continuations_exact(found, model)


def test_layers_that_fail_the_identity_leave_the_bridge(
    models64: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import lensdiv.ops.inspection as inspection_module
    import lensdiv.ops.kvcache as kvcache

    class Off(torch.nn.Module):  # a layer that is one part in a million off
        def __init__(self, layer: Any) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = self.layer(*args, **kwargs)
            return (out[0] * (1 + 1e-6), *out[1:]) if isinstance(out, tuple) else out * (1 + 1e-6)

    def off(model: Any, attention: str | None = None) -> list[Any]:
        layers = pure_layers(model, attention)
        assert layers is not None
        return [Off(layers[0]), *layers[1:]]

    monkeypatch.setattr(inspection_module, "pure_layers", off)
    monkeypatch.setattr(kvcache, "_WARNED", set())
    model = models64["gpt2"]
    with pytest.warns(FallbackWarning, match="Hugging Face's own layers.*identity is off"):
        found = Inspection(model, DEFAULT_PROMPT, -1)
    assert found.mode == "cache" and found.layers == "bridge" and found._calls == {}
    assert_continuations_exact(found, model)


@pytest.mark.parametrize("arch", ARCHS)
def test_resuming_through_the_pure_layers_equals_the_bridge(models64: dict[str, Any],
                                                            arch: str) -> None:
    """A resumed pass whose hooks all sit between blocks runs the pure layers (the model's own
    KV cache, which its forward makes, not kept from one call to the next): the same logits
    and hooked states as the bridge's resumed pass (float32); a hook inside a block, or a
    float64 model, keeps the bridge."""
    from lensdiv.ops.resume import Resumer

    model = models64[arch].to(torch.float32)  # float64 keeps the bridge (below)
    L = int(model.cfg.n_layers)
    tokens = model.to_tokens(["The happy dog ran to the", "A cat sat on a mat there"])
    info = ModelInfo.from_model(model)
    names = [info.resid(layer) for layer in range(L + 1)]
    with torch.no_grad():
        _, cache = capture(model, tokens, names, need_logits=False)
    pure, bridge = Resumer(model), Resumer(model)
    pure.prepare(tokens)
    bridge.prepare(tokens)
    assert pure.mode == "resume" and pure.pure is not None
    bridge.pure = None
    shift = torch.randn(model.cfg.d_model,
                        generator=torch.Generator().manual_seed(0))

    def edit(tensor: torch.Tensor, *, hook: Any) -> torch.Tensor:
        return tensor + shift

    for start in (0, 1):
        kept: dict[str, list[torch.Tensor]] = {"pure": [], "bridge": []}
        outs = {}
        for key, resumer in (("pure", pure), ("bridge", bridge)):
            def keep(tensor: torch.Tensor, *, hook: Any, into: list = kept[key]) -> torch.Tensor:
                into.append(tensor.clone())
                return tensor

            hooks = [(f"blocks.{start}.hook_resid_post", edit),
                     (f"blocks.{L - 1}.hook_resid_post", keep)]
            outs[key] = [resumer.run(tokens, start, cache[names[start]], hooks)
                         for _ in range(2)]  # twice: nothing kept from the first call
        for got, want in zip(outs["pure"] + kept["pure"], outs["bridge"] + kept["bridge"],
                             strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    model.to(torch.float64)
    exact = Resumer(model)
    exact.prepare(tokens)
    assert exact.mode == "resume" and exact.pure is None  # float64: the bridge, exact
    model.to(torch.float32)
    inside = [(f"blocks.{L - 1}.attn.hook_pattern", lambda t, hook: t)]
    assert (pure.pure is not None) and pure.run(tokens, 1, cache[names[1]], inside) is not None
    assert pure._calls is not None  # recorded by the between-block runs above...
    calls = pure._calls
    pure.run(tokens, 1, cache[names[1]], inside)  # ...and not used by a hook inside a block
    assert pure._calls is calls
    model.to(torch.float64)  # the shared fixture as it was
