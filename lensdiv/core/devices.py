"""Where and in which precision a model runs: device and dtype names, and moving a bridge."""

from __future__ import annotations

from typing import Any

from lensdiv.core.errors import ModelLoadError

DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float64": "float64",
    "fp64": "float64",
}


def parse_dtype(dtype: Any) -> Any:
    """Turn ``"bf16"`` and friends into a ``torch.dtype`` (``None`` stays ``None``)."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = DTYPES.get(str(dtype).lower())
    if name is None:
        raise ModelLoadError(f"unknown dtype {dtype!r}", hint=f"use one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def parse_device(device: Any) -> str:
    """``None``/``"auto"`` → CUDA when available, else CPU."""
    import torch

    if device is None or str(device) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def place_model(model: Any, device: Any = None, dtype: Any = None) -> Any:
    """Move a bridge to ``device``/``dtype`` unless it is already there.

    TransformerLens prints a line on every ``.to``; a no-op move must not print.
    """
    import torch

    param = next(model.parameters())
    if device is not None:
        target = torch.device(parse_device(device))
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        if param.device != target:
            model = model.to(target)
    if dtype is not None and param.dtype != parse_dtype(dtype):
        model = model.to(parse_dtype(dtype))
    return model
