"""Tiny, randomly initialised Hugging Face causal LMs for tests and benchmarks.

Every architecture is built from a config (3 layers, d_model 32, 4 heads, d_mlp 64,
vocab = the lensdiv byte tokenizer, 128 positions, fp32, dropout 0), saved with
``save_pretrained`` together with the byte tokenizer, and booted through
``TransformerBridge.boot_transformers`` — no hub access, no downloaded weights.

Findings with TransformerLens 4.3 (checked by tests/test_architectures.py):

arch   HF class            cfg.normalization_type  cfg.parallel_attn_mlp  hook_resid_mid
gpt2   GPT2LMHeadModel     "LN"                    False                  yes
llama  LlamaForCausalLM    "RMS"                   False                  yes  (GQA 4q/2kv)
neox   GPTNeoXForCausalLM  "LN"                    True                   NO   (parallel block)
qwen2  Qwen2ForCausalLM    "RMS"                   False                  yes  (GQA 4q/2kv)
olmo   OlmoForCausalLM     "LN" (non-learnable)    False                  yes
olmo2  Olmo2ForCausalLM    "RMS"                   False                  yes  (post-norm only)

- The parallel-residual flag is ``model.cfg.parallel_attn_mlp`` (the NeoX adapter copies HF's
  ``use_parallel_residual`` into it; the raw ``use_parallel_residual`` is also on the neox cfg).
- Hook names lensdiv uses are aliases: ``hook_resid_pre`` == ``blocks.{l}.hook_in`` and
  ``hook_resid_post`` == ``blocks.{l}.hook_out`` (both keys show up in an unfiltered cache).
  ``hook_attn_out`` / ``hook_mlp_out`` are exactly what is added to the stream, so
  ``resid_post = resid_pre + attn_out + mlp_out`` holds for every arch (parallel NeoX included;
  for OLMo-2 they are the *post-normed* sublayer outputs) and ``resid_mid = resid_pre + attn_out``.
- Bridge logits equal HF eager logits exactly (0.0) except gpt2 (1.7e-6; its adapter uses
  JointQKVAttentionBridge, which splits c_attn itself); HF's sdpa differs by <5e-6 everywhere.
- ``cfg.default_prepend_bos`` is False for neox and qwen2 (adapter policy), True elsewhere:
  ``model.to_tokens(text)`` adds <bos> only for gpt2/llama/olmo/olmo2 unless prepend_bos=True.
- transformers 5 ignores the saved tokenizer class for ``model_type == "qwen2"`` and loads
  ``Qwen2Tokenizer``, which adds an NFC normalizer: same ids as the byte tokenizer on NFC
  text, different on decomposed text ("e" + U+0301 becomes U+00E9). The other archs load
  the saved tokenizer as ``TokenizersBackend``.
- boot_native_tiny: "LN", parallel_attn_mlp False, hook_resid_mid present.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    Olmo2Config,
    OlmoConfig,
    PretrainedConfig,
    Qwen2Config,
)

from lensdiv.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, byte_tokenizer

N_LAYERS = 3
D_MODEL = 32
N_HEADS = 4
N_KV_HEADS = 2  # grouped-query attention for llama / qwen2
D_MLP = 2 * D_MODEL  # every config uses intermediate size 2 * d_model
N_CTX = 128
# Weight-init std. HF defaults (0.02) leave a 3-layer, d_model-32 model with near-uniform
# attention (max prob 0.086 vs 1/12 uniform) and sublayer outputs ~10x smaller than the
# embeddings, so position/mask/rotary bugs would hide under a 1e-4 tolerance. 0.2 gives peaked
# attention (max 0.26-0.52), sublayers that dominate the stream and logits with std ~1.1.
INIT_STD = 0.2

_SPECIAL_IDS: dict[str, Any] = {
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}


def _gpt2(n_layers: int = N_LAYERS, d_model: int = D_MODEL) -> PretrainedConfig:
    return GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=N_CTX,
        n_embd=d_model,
        n_layer=n_layers,
        n_head=N_HEADS,
        n_inner=2 * d_model,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        **_SPECIAL_IDS,
    )


# Keyword arguments every non-GPT-2 config shares: tiny shape, no dropout, untied, byte ids.
_NO_DROPOUT_UNTIED: dict[str, Any] = {
    "max_position_embeddings": N_CTX,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    **_SPECIAL_IDS,
}


def _shape(n_layers: int, d_model: int) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": d_model,
        "intermediate_size": 2 * d_model,
        "num_hidden_layers": n_layers,
        "num_attention_heads": N_HEADS,
    }


def _llama(n_layers: int = N_LAYERS, d_model: int = D_MODEL) -> PretrainedConfig:
    return LlamaConfig(
        **_shape(n_layers, d_model),
        num_key_value_heads=N_KV_HEADS,
        **_NO_DROPOUT_UNTIED,
    )


def _neox(n_layers: int = N_LAYERS, d_model: int = D_MODEL) -> PretrainedConfig:
    return GPTNeoXConfig(
        **_shape(n_layers, d_model),
        rotary_pct=0.25,  # type: ignore[call-arg]  # read from **kwargs into rope_parameters
        use_parallel_residual=True,
        hidden_dropout=0.0,
        classifier_dropout=0.0,
        **_NO_DROPOUT_UNTIED,
    )


def _qwen2(n_layers: int = N_LAYERS, d_model: int = D_MODEL) -> PretrainedConfig:
    return Qwen2Config(
        **_shape(n_layers, d_model),
        num_key_value_heads=N_KV_HEADS,
        use_sliding_window=False,
        **_NO_DROPOUT_UNTIED,
    )


def _olmo(n_layers: int = N_LAYERS, d_model: int = D_MODEL) -> PretrainedConfig:
    return OlmoConfig(
        **_shape(n_layers, d_model),
        **_NO_DROPOUT_UNTIED,
    )


def _olmo2(n_layers: int = N_LAYERS, d_model: int = D_MODEL) -> PretrainedConfig:
    # Post-norm only (norm on each sublayer's output before the residual add) plus Q/K norm.
    return Olmo2Config(
        **_shape(n_layers, d_model),
        **_NO_DROPOUT_UNTIED,
    )


ARCHITECTURES: dict[str, Callable[..., PretrainedConfig]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "neox": _neox,
    "qwen2": _qwen2,
    "olmo": _olmo,
    "olmo2": _olmo2,
}


def softcap_config(n_layers: int = 2, d_model: int = D_MODEL) -> PretrainedConfig:
    """A tiny Gemma-2 config with final logit soft-capping (``30·tanh(z/30)``): the logits are
    no sum of member contributions, so ``bias`` and ``submod`` (direct mode) must be skipped on
    it. Not in :data:`ARCHITECTURES`, which every analyzer supports."""
    config = Gemma2Config(
        **_shape(n_layers, d_model),
        num_key_value_heads=N_KV_HEADS,
        head_dim=d_model // N_HEADS,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        sliding_window=N_CTX,
        **_NO_DROPOUT_UNTIED,
    )
    config.dtype = torch.float32
    config.initializer_range = INIT_STD
    return config


def save_softcapped_model(directory: Path, *, seed: int = 0) -> Path:
    """Build and save (with the byte tokenizer) the model of :func:`softcap_config`."""
    directory = Path(directory)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(softcap_config(), dtype=torch.float32)
    model.eval().save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def save_codegen_model(directory: Path, *, rotary_dim: int = 4, seed: int = 0) -> Path:
    """Build and save (with the byte tokenizer) a tiny CodeGen model, 2 layers: an
    architecture outside :data:`ARCHITECTURES` whose attention TransformerLens replaces with
    its own component. ``rotary_dim`` beyond the head size (8; CodeGen's default is 64) makes a
    model TransformerLens boots but cannot run."""
    from transformers import CodeGenConfig

    config = CodeGenConfig(
        vocab_size=VOCAB_SIZE,
        n_positions=N_CTX,
        n_ctx=N_CTX,
        n_embd=D_MODEL,
        n_layer=2,
        n_head=N_HEADS,
        n_inner=D_MLP,
        rotary_dim=rotary_dim,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        **_SPECIAL_IDS,
    )
    config.dtype = torch.float32
    directory = Path(directory)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval().save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def tiny_config(
    arch: str, *, n_layers: int = N_LAYERS, d_model: int = D_MODEL, init_std: float = INIT_STD
) -> PretrainedConfig:
    """The config of a tiny ``arch`` model (fp32, dropout 0, byte-tokenizer special ids)."""
    if arch not in ARCHITECTURES:
        raise KeyError(f"unknown architecture {arch!r}; known: {sorted(ARCHITECTURES)}")
    if d_model % N_HEADS:
        raise ValueError(f"d_model={d_model} must be divisible by {N_HEADS} heads")
    config = ARCHITECTURES[arch](n_layers=n_layers, d_model=d_model)
    config.dtype = torch.float32
    config.initializer_range = init_std
    return config


def save_tiny_model(
    arch: str,
    directory: Path,
    *,
    n_layers: int = N_LAYERS,
    d_model: int = D_MODEL,
    seed: int = 0,
    init_std: float = INIT_STD,
) -> Path:
    """Build a tiny random ``arch`` model and save it (plus the byte tokenizer) to ``directory``.

    Deterministic for a given ``seed``; the global torch RNG is left untouched.
    """
    directory = Path(directory)
    config = tiny_config(arch, n_layers=n_layers, d_model=d_model, init_std=init_std)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def boot_tiny(arch: str, directory: Path) -> Any:
    """Boot a saved tiny model through TransformerLens 4 (CPU, fp32, eval mode).

    ``arch`` is only checked for consistency; the architecture comes from the saved config.
    """
    from transformer_lens.model_bridge import TransformerBridge

    if arch not in ARCHITECTURES:
        raise KeyError(f"unknown architecture {arch!r}; known: {sorted(ARCHITECTURES)}")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu", dtype=torch.float32)
    return bridge.eval()  # bridges come back in training mode


def boot_native_tiny(n_layers: int = N_LAYERS, d_model: int = D_MODEL, seed: int = 0) -> Any:
    """A TL-native tiny model (no ``transformers`` model at all) with the byte tokenizer."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(
        d_model=d_model,
        d_head=d_model // N_HEADS,
        n_layers=n_layers,
        n_ctx=N_CTX,
        n_heads=N_HEADS,
        d_mlp=2 * d_model,
        d_vocab=VOCAB_SIZE,
        act_fn="gelu",
        normalization_type="LN",
        seed=seed,
    )
    # boot_native is attached to the class when its source module loads; mypy cannot see it.
    bridge = TransformerBridge.boot_native(cfg, tokenizer=byte_tokenizer())  # type: ignore[attr-defined]  # see above
    return bridge.eval()
