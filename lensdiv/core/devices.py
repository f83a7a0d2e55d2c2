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
    """``None``/``"auto"`` → CUDA when available, else CPU; any other device is checked to exist
    on this machine (:func:`check_device`)."""
    import torch

    if device is None or str(device) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return check_device(device)


_DEVICE_HINT = "use --device cpu, cuda, cuda:N or mps (default: cuda when available, else cpu)"


def check_device(device: Any) -> str:
    """The name of ``device`` (``"cpu"``, ``"cuda:1"``, a ``torch.device`` or a GPU index), after
    checking that this machine has it.

    Raises:
        ModelLoadError: Not a device name, a device type lensdiv does not run on, or one this
            machine lacks (no CUDA, a GPU index beyond those visible, no MPS).
    """
    import torch

    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ModelLoadError(
            f"device must be a name such as 'cpu' or 'cuda:0', not {device!r} "
            f"({type(device).__name__})",
            hint=_DEVICE_HINT,
        )
    try:
        dev = torch.device(device.strip().lower() if isinstance(device, str) else device)
    except (RuntimeError, ValueError, TypeError):
        raise ModelLoadError(f"unknown device {device!r}", hint=_DEVICE_HINT) from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch was built without CUDA"
                if torch.version.cuda is None
                else ("no GPU is visible")
            )
            raise ModelLoadError(
                f"device {str(device)!r} needs CUDA, which is not available here ({why})",
                hint="use --device cpu, or run on a machine with a GPU",
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ModelLoadError(
                f"device {str(device)!r} does not exist: {count} GPU(s) visible "
                f"(cuda:0 to cuda:{count - 1})",
                hint="pick a visible GPU (see CUDA_VISIBLE_DEVICES)",
            )
        return str(dev)
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ModelLoadError(
                f"device {str(device)!r} (Apple GPU) is not available here",
                hint="use --device cpu, or cuda on a machine with an NVIDIA GPU",
            )
        return str(dev)
    raise ModelLoadError(
        f"device {str(device)!r} ({dev.type}) is not supported by lensdiv", hint=_DEVICE_HINT
    )


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
