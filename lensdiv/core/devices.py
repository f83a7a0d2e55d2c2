"""Where and in which precision a model runs: device and dtype names, device maps that split a
model across devices, and where a module of a split model computes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lensdiv.core.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

    from lensdiv.core.bridge import Bridge

# accelerate's placement strategies (``device_map="auto"`` and friends).
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_SIZE = re.compile(r"^\s*\d+(\.\d+)?\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)

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


def place_model(model: Bridge, device: Any = None, dtype: Any = None) -> Bridge:
    """Move a bridge to ``device``/``dtype`` unless it is already there.

    TransformerLens prints a line on every ``.to``; a no-op move must not print. A model split
    across devices by a device map stays where the map put it.
    """
    import torch

    if device_map_of(model) is not None:
        return model
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


def parse_device_map(device_map: Any) -> str | dict[str, int | str] | None:
    """``auto | balanced | balanced_low_0 | sequential``, a JSON file of ``{module: device}``
    or such a dict, as Hugging Face's ``from_pretrained(device_map=...)`` takes it.

    Devices are GPU indices (``0``), ``"cuda:1"``, ``"cpu"`` or ``"disk"`` (weights offloaded
    to ``--offload-folder`` and loaded for each call).

    Raises:
        ModelLoadError: An unknown strategy, a missing or malformed file, a bad device.
    """
    if device_map is None or isinstance(device_map, dict):
        return _check_map(device_map, "the device map") if device_map is not None else None
    text = str(device_map).strip()
    if text in DEVICE_MAP_STRATEGIES:
        return text
    path = Path(text).expanduser()
    if not path.is_file():
        raise ModelLoadError(
            f"device map {text!r} is neither a strategy nor a JSON file",
            hint=f"use one of {', '.join(DEVICE_MAP_STRATEGIES)} or a FILE.json of "
            '{"module": device}, e.g. {"model.embed_tokens": 0, "lm_head": "cpu"}',
        )
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelLoadError(f"cannot read device map {text!r}: {err}") from None
    if not isinstance(loaded, dict) or not loaded:
        raise ModelLoadError(
            f"device map {text!r} must be a non-empty JSON object of {{module: device}}"
        )
    return _check_map(loaded, f"device map {text!r}")


def _check_map(device_map: dict[Any, Any], where: str) -> dict[str, int | str]:
    out: dict[str, int | str] = {}
    for module, device in device_map.items():
        if isinstance(device, bool) or not isinstance(device, (int, str)):
            raise ModelLoadError(f"{where}: module {module!r} has device {device!r}")
        if isinstance(device, str) and not re.fullmatch(r"cpu|disk|mps|cuda(:\d+)?|\d+", device):
            raise ModelLoadError(
                f"{where}: module {module!r} has unknown device {device!r}",
                hint="use a GPU index (0), cuda:N, cpu or disk",
            )
        out[str(module)] = int(device) if isinstance(device, str) and device.isdigit() else device
    return out


def parse_max_memory(max_memory: Any) -> dict[int | str, str] | None:
    """``"0=70GiB,1=70GiB,cpu=200GiB"`` (or such a dict) → ``{0: "70GiB", 1: "70GiB",
    "cpu": "200GiB"}``: the most each device may hold when a device map is computed.

    Raises:
        ModelLoadError: An entry without ``=``, an unknown device or a size that does not parse.
    """
    if max_memory is None:
        return None
    items: Iterable[tuple[Any, Any]]
    if isinstance(max_memory, dict):
        items = max_memory.items()
    else:
        items = []
        for part in str(max_memory).split(","):
            key, eq, value = part.partition("=")
            if not part.strip():
                continue
            if not eq:
                raise ModelLoadError(
                    f"bad --max-memory entry {part.strip()!r}",
                    hint="write DEVICE=SIZE,..., e.g. 0=70GiB,1=70GiB,cpu=200GiB",
                )
            items.append((key.strip(), value.strip()))
    out: dict[int | str, str] = {}
    for key, value in items:
        name = str(key).strip()
        device: int | str = int(name) if name.isdigit() else name
        if isinstance(device, str) and device not in ("cpu", "disk", "mps"):
            raise ModelLoadError(
                f"--max-memory names unknown device {name!r}", hint="use GPU indices, cpu or disk"
            )
        if not _SIZE.match(str(value)):
            raise ModelLoadError(
                f"--max-memory size {value!r} of device {name!r} does not parse",
                hint="write sizes like 70GiB, 500MB or a number of bytes",
            )
        out[device] = str(value).replace(" ", "")
    if not out:
        raise ModelLoadError("--max-memory is empty", hint="e.g. 0=70GiB,1=70GiB,cpu=200GiB")
    return out


def execution_device(module: Any) -> torch.device | None:
    """The device ``module`` computes on, or ``None`` when nothing says.

    A model dispatched with a device map (accelerate) may keep a module's weights on the
    ``meta`` device, offloaded to CPU or disk, and load them on the module's *execution
    device* for each call: that device is read off accelerate's hook. Otherwise it is the
    device of the module's first materialised parameter or buffer. TransformerLens bridge
    components wrap the Hugging Face module (``original_component``); both are asked.
    """
    import torch

    candidates = [c for c in (module, getattr(module, "original_component", None)) if c is not None]
    for candidate in candidates:
        hooks = [getattr(candidate, "_hf_hook", None)]
        while hooks:
            hook = hooks.pop()
            hooks.extend(getattr(hook, "hooks", None) or ())  # accelerate's SequentialHook
            device = getattr(hook, "execution_device", None)
            if device is not None:
                return (
                    torch.device("cuda", device)
                    if isinstance(device, int)
                    else torch.device(device)
                )
    for candidate in candidates:
        if isinstance(candidate, torch.nn.Module):
            for tensor in (*candidate.parameters(), *candidate.buffers()):
                if tensor.device.type != "meta":
                    return tensor.device
    return None


def input_device(model: Bridge) -> torch.device:
    """Where token ids must go: where the embedding computes (:func:`execution_device`), else
    the first materialised parameter's device, else the first parameter's."""
    embed = getattr(model, "embed", None)
    device = execution_device(embed) if embed is not None else None
    if device is not None:
        return device
    devices: list[torch.device] = [param.device for param in model.parameters()]
    return next((d for d in devices if d.type != "meta"), devices[0])


def stack_on(
    tensors: Iterable[torch.Tensor], device: torch.device | None = None, dim: int = 0
) -> torch.Tensor:
    """``torch.stack`` of tensors that may live on different devices (the layers of a model
    split across GPUs), on ``device`` (default: the first tensor's)."""
    import torch

    parts = list(tensors)
    target = parts[0].device if device is None else device
    return torch.stack([t.to(target) for t in parts], dim=dim)


def masked_stack(tensors: Iterable[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """``torch.stack([t[mask] for t in tensors])`` on the mask's device, for tensors that may
    live on different devices (the layers of a split model): each is indexed where it lives,
    so only the selected rows move."""
    import torch

    return torch.stack([t[mask.to(t.device)].to(mask.device) for t in tensors])


def device_map_of(model: Bridge) -> dict[str, str] | None:
    """Where each module of a dispatched model was placed (Hugging Face's ``hf_device_map``,
    as strings), or ``None`` for a model on one device."""
    for owner in (model, getattr(model, "original_model", None)):
        placed = getattr(owner, "hf_device_map", None)
        if placed:
            return {str(k): str(v) for k, v in dict(placed).items()}
    return None
