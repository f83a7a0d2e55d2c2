"""Every tiny architecture boots through TL 4 and exposes what lensdiv relies on.

Checked per architecture: bridge logits == HF logits; the four residual-stream hooks exist and
fire; the residual stream decomposes exactly into embeddings + sublayer outputs; and
``ln_final(h_L) @ W_U + b_U`` (the logit-lens readout) reproduces the model's output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformer_lens.tools.analysis.logit_lens import logit_readout
from transformers import AutoModelForCausalLM

from lensdiv.data.tokenizer import BOS_ID, VOCAB_SIZE, byte_tokenizer
from lensdiv.testing.models import boot_native_tiny, save_tiny_model

HOOK_TEMPLATES = (
    "blocks.{layer}.hook_resid_pre",
    "blocks.{layer}.hook_attn_out",
    "blocks.{layer}.hook_mlp_out",
    "blocks.{layer}.hook_resid_post",
)
BATCH, POS = 2, 12

# What TL 4.3 reports per architecture (documented at the top of lensdiv/testing/models.py):
# (cfg.normalization_type, cfg.parallel_attn_mlp, has blocks.{layer}.hook_resid_mid,
#  cfg.default_prepend_bos)
EXPECTED_FINDINGS = {
    "gpt2": ("LN", False, True, True),
    "llama": ("RMS", False, True, True),
    "neox": ("LN", True, False, False),
    "qwen2": ("RMS", False, True, False),
    "olmo": ("LN", False, True, True),
    "olmo2": ("RMS", False, True, True),
}


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    toks = torch.randint(4, VOCAB_SIZE, (BATCH, POS), generator=gen)
    toks[:, 0] = BOS_ID
    return toks


def _hook_names(model: Any) -> list[str]:
    return [t.format(layer=i) for i in range(model.cfg.n_layers) for t in HOOK_TEMPLATES]


def _run(model: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
    with torch.no_grad():
        return model.run_with_cache(tokens, names_filter=_hook_names(model))


def _check_hooks(model: Any, tokens: torch.Tensor) -> None:
    names = _hook_names(model)
    missing = [n for n in names if n not in model.hook_dict]
    assert not missing, f"missing hooks: {missing}"
    _, cache = _run(model, tokens)
    for name in names:
        assert name in cache, f"{name} did not fire"
        assert cache[name].shape == (BATCH, POS, model.cfg.d_model), name
        assert torch.isfinite(cache[name]).all(), name


def _check_residual_identity(model: Any, tokens: torch.Tensor) -> None:
    n_layers = model.cfg.n_layers
    _, cache = _run(model, tokens)
    h0 = cache["blocks.0.hook_resid_pre"]
    h_last = cache[f"blocks.{n_layers - 1}.hook_resid_post"]
    total = h0.clone()
    for layer in range(n_layers):
        a, m = cache[f"blocks.{layer}.hook_attn_out"], cache[f"blocks.{layer}.hook_mlp_out"]
        # Per block: resid_post = resid_pre + attn_out + mlp_out (parallel blocks included).
        torch.testing.assert_close(
            cache[f"blocks.{layer}.hook_resid_post"],
            cache[f"blocks.{layer}.hook_resid_pre"] + a + m,
            atol=1e-5,
            rtol=0,
        )
        total = total + a + m
    torch.testing.assert_close(h_last, total, atol=1e-5, rtol=0)
    for layer in range(n_layers - 1):
        torch.testing.assert_close(
            cache[f"blocks.{layer}.hook_resid_post"],
            cache[f"blocks.{layer + 1}.hook_resid_pre"],
            atol=0,
            rtol=0,
        )


def _check_logit_lens(model: Any, tokens: torch.Tensor) -> None:
    n_layers = model.cfg.n_layers
    logits, cache = _run(model, tokens)
    h_last = cache[f"blocks.{n_layers - 1}.hook_resid_post"]
    readout = logit_readout(model, h_last, return_type="log_probs")
    assert readout.applied_ln
    torch.testing.assert_close(
        readout.values, torch.log_softmax(logits.float(), dim=-1), atol=1e-4, rtol=0
    )
    # The same by hand: ln_final(h_L) @ W_U + b_U.
    with torch.no_grad():
        manual = model.ln_final(h_last) @ model.W_U + model.b_U
    torch.testing.assert_close(manual, logits, atol=1e-4, rtol=0)


def test_logits_match_hf(
    tiny_model: Any, tiny_arch: str, tiny_dirs: dict[str, Path], tokens: torch.Tensor
) -> None:
    # The bridge forces eager attention; load HF the same way (sdpa also agrees to ~1e-7 here).
    hf = AutoModelForCausalLM.from_pretrained(
        tiny_dirs[tiny_arch], attn_implementation="eager"
    ).eval()
    assert not tiny_model.training
    with torch.no_grad():
        expected = hf(tokens).logits
        got = tiny_model(tokens)
    assert got.shape == (BATCH, POS, VOCAB_SIZE)
    assert got.dtype == torch.float32
    assert expected.std() > 0.5, "random logits too flat for the comparison to mean much"
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_hooks_exist_and_fire(tiny_model: Any, tokens: torch.Tensor) -> None:
    _check_hooks(tiny_model, tokens)


def test_residual_identity(tiny_model: Any, tokens: torch.Tensor) -> None:
    _check_residual_identity(tiny_model, tokens)


def test_logit_lens_readout_reproduces_logits(tiny_model: Any, tokens: torch.Tensor) -> None:
    _check_logit_lens(tiny_model, tokens)


def test_documented_findings(tiny_model: Any, tiny_arch: str, tokens: torch.Tensor) -> None:
    cfg = tiny_model.cfg
    has_mid = all(
        f"blocks.{layer}.hook_resid_mid" in tiny_model.hook_dict for layer in range(cfg.n_layers)
    )
    found = (cfg.normalization_type, bool(cfg.parallel_attn_mlp), has_mid, cfg.default_prepend_bos)
    assert found == EXPECTED_FINDINGS[tiny_arch]
    if tiny_arch in ("llama", "qwen2"):
        assert cfg.n_key_value_heads < cfg.n_heads  # grouped-query attention survived the boot
    if has_mid:  # resid_mid sits between the sublayers: resid_pre + attn_out
        names = [
            f"blocks.{layer}.{h}"
            for layer in range(cfg.n_layers)
            for h in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid")
        ]
        with torch.no_grad():
            _, cache = tiny_model.run_with_cache(tokens, names_filter=names)
        for layer in range(cfg.n_layers):
            torch.testing.assert_close(
                cache[f"blocks.{layer}.hook_resid_mid"],
                cache[f"blocks.{layer}.hook_resid_pre"] + cache[f"blocks.{layer}.hook_attn_out"],
                atol=1e-5,
                rtol=0,
            )


def test_saved_tokenizer_matches_byte_tokenizer(tiny_model: Any) -> None:
    # NFC text only: transformers 5 swaps the saved tokenizer of a qwen2 dir for Qwen2Tokenizer,
    # whose NFC normalizer re-encodes decomposed characters ("e\u0301" -> "é").
    reference = byte_tokenizer()
    for text in ["hi", "Hello, world!  two  spaces\n\tnewline", "café naïve 日本語 🎉", "'s 123"]:
        expected = reference(text)["input_ids"]
        assert expected[0] == BOS_ID
        assert tiny_model.to_tokens(text, prepend_bos=True)[0].tolist() == expected
        assert tiny_model.tokenizer.decode(expected[1:]) == text


def test_save_is_deterministic(tmp_path: Path) -> None:
    a = load_file(save_tiny_model("llama", tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(save_tiny_model("llama", tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(save_tiny_model("llama", tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.endswith("weight"))


def test_native_tiny(tokens: torch.Tensor) -> None:
    model = boot_native_tiny()
    assert not model.training
    _check_hooks(model, tokens)
    _check_residual_identity(model, tokens)
    _check_logit_lens(model, tokens)
