"""Model loading: one entry point for hub names, local Hugging Face folders, toy models and bridges.

Raw Hugging Face numerics by default (norms and angles need them); folded weights only when an
analyzer declares ``numerics = "folded"``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lensdiv.core.devices import (
    parse_device,
    parse_device_map,
    parse_dtype,
    parse_max_memory,
    place_model,
)
from lensdiv.core.errors import ModelLoadError
from lensdiv.core.files import folder_problem
from lensdiv.core.progress import progress_shown
from lensdiv.models import catalog, gguf
from lensdiv.models.toy import load_toy

DEFAULT_MODEL = "toy"

# Short names people type that the TransformerLens registry only knows under their hub ids.
ALIASES = {
    "gpt2": "openai-community/gpt2",
    "gpt2-small": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
}


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model spec.

    Args:
        spec: What the user typed.
        kind: ``"toy"``, ``"local"``, ``"hub"``, ``"gguf"`` (a GGUF file), ``"real"`` (a real
            model of the catalog, ``smollm2-135m``) or ``"bridge"``.
        resolved: The toy name, absolute folder or file, hub id or catalog name.
        origin: Where the weights came from when they were converted (a GGUF file: its name,
            sha256 and quantization, ``gguf.GGUFFacts.describe``), for the manifest.
    """

    spec: str
    kind: str
    resolved: str
    origin: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        """The model's name as reports show it (``smollm2-135m, dequantized from Q4_1``)."""
        if self.origin and self.origin.get("format") == "gguf":
            return f"{self.spec} (dequantized from {self.origin['quant_label']})"
        return self.spec


def resolve_spec(spec: str) -> ModelSpec:
    """Classify a spec string without loading anything (no network, no TransformerLens)."""
    text = spec.strip()
    if not text:
        raise ModelLoadError("empty model spec", hint="pass a hub name, a local folder or 'toy'")
    if text == "toy" or text.startswith("toy:"):
        return ModelSpec(text, "toy", text)
    named = catalog.real_model(text)
    if named is not None:
        return ModelSpec(text, "real", named.name)
    path = Path(os.path.expanduser(text))
    if path.exists() and gguf.is_gguf_path(path):
        return ModelSpec(text, "gguf", str(gguf.gguf_file(path).resolve()))
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{text!r} is not a Hugging Face model folder (no config.json)",
                hint="pass a folder written by save_pretrained, a hub name, or 'toy'",
            )
        return ModelSpec(text, "local", str(path.resolve()))
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or os.sep + os.sep in text:
        raise ModelLoadError(
            f"model folder {text!r} does not exist",
            hint="check the path, or pass a hub name or 'toy'",
        )
    resolved = ALIASES.get(text.lower())
    if resolved is None:
        resolved = _registry_aliases().get(text, text)
    return ModelSpec(text, "hub", resolved)


def _registry_aliases() -> dict[str, str]:
    """TransformerLens' alias table (short name -> hub id), read without importing the package."""
    import importlib.util
    import json

    spec = importlib.util.find_spec("transformer_lens")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(next(iter(spec.submodule_search_locations)))
    path = path / "tools" / "model_registry" / "data" / "model_aliases.json"
    try:
        table = json.loads(path.read_text())["aliases"]
    except (OSError, KeyError, ValueError):  # the table moved: the plain id is still worth trying
        return {}
    return {alias: official for official, aliases in table.items() for alias in aliases}


def load_model(
    spec: Any = DEFAULT_MODEL,
    *,
    device: Any = None,
    dtype: Any = None,
    trust_remote_code: bool = False,
    numerics: str = "raw",
    progress: bool = True,
    device_map: Any = None,
    max_memory: Any = None,
    offload_folder: str | Path | None = None,
) -> Any:
    """Load a ``TransformerBridge`` in eval mode.

    Args:
        spec: A hub name (``gpt2-medium``, ``EleutherAI/pythia-70m``), a local Hugging Face
            folder (a string or a path), a built-in toy model (``toy``, ``toy:d4``), or a
            ``TransformerBridge``.
        device: ``"cpu"``, ``"cuda"``, ... or ``None`` for the best available.
        dtype: ``"float32"``, ``"bf16"``, a ``torch.dtype`` or ``None`` (float32).
        trust_remote_code: Allow hub models that ship their own code.
        numerics: ``"raw"`` (default) or ``"folded"`` (``enable_compatibility_mode``).
        progress: Show a progress bar when a toy model must be trained first.
        device_map: Split a Hugging Face model across devices (accelerate): ``"auto"``,
            ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``, a JSON file or a dict of
            ``{module: device}`` (GPU index, ``"cpu"`` or ``"disk"``). Replaces ``device``.
        max_memory: Most each device may hold when the map is computed:
            ``"0=70GiB,1=70GiB,cpu=200GiB"`` or ``{0: "70GiB", "cpu": "200GiB"}``.
        offload_folder: Where weights mapped to ``"disk"`` are kept.

    Returns:
        The bridge, with ``model.lensdiv_spec`` set to the resolved :class:`ModelSpec`.

    Raises:
        ModelLoadError: The spec names nothing loadable; the message says what was tried.
    """
    torch_dtype = parse_dtype(dtype)
    progress = progress and progress_shown()  # --no-progress reaches loads an analyzer starts
    if isinstance(spec, os.PathLike):  # a local folder given as a Path
        spec = os.fspath(spec)
    placement = _placement(spec, device_map, max_memory, offload_folder)
    if not isinstance(spec, str):
        model = spec
        if not hasattr(model, "hook_dict") or not hasattr(model, "cfg"):
            raise ModelLoadError(
                f"cannot analyze a {type(model).__name__}: pass a TransformerBridge or a spec string"
            )
        model = place_model(model, device, torch_dtype)
        parsed = getattr(model, "lensdiv_spec", None) or ModelSpec(
            str(getattr(model.cfg, "model_name", "bridge")),
            "bridge",
            str(getattr(model.cfg, "model_name", "bridge")),
        )
    else:
        parsed = resolve_spec(spec)
        device = parse_device(device)
        if parsed.kind == "toy":
            model = load_toy(parsed.resolved, device=device, dtype=torch_dtype, progress=progress)
        elif parsed.kind in ("gguf", "real"):
            parsed, folder = _converted(parsed, progress)
            model = _boot_hf(
                ModelSpec(parsed.spec, "local", str(folder)),
                device=device,
                dtype=torch_dtype,
                trust_remote_code=trust_remote_code,
                progress=progress,
                **placement,
            )
        else:
            model = _boot_hf(
                parsed,
                device=device,
                dtype=torch_dtype,
                trust_remote_code=trust_remote_code,
                progress=progress,
                **placement,
            )
    if any(module.training for module in model.modules()):  # a whole eval() walk costs ~0.1 s
        model.eval()
    if numerics == "folded" and not getattr(model, "compatibility_mode", False):
        model.enable_compatibility_mode()
    model.lensdiv_spec = parsed
    return model


def _placement(
    spec: Any, device_map: Any, max_memory: Any, offload_folder: str | Path | None
) -> dict[str, Any]:
    """The keyword arguments that split a model across devices, checked (none: ``{}``)."""
    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            flag = "--max-memory" if max_memory is not None else "--offload-folder"
            raise ModelLoadError(
                f"{flag} only applies with a device map", hint="add --device-map auto"
            )
        return {}
    kind = resolve_spec(spec).kind if isinstance(spec, str) else "bridge"
    if kind not in ("hub", "local", "gguf", "real"):
        raise ModelLoadError(
            f"--device-map needs a Hugging Face model (hub id or local folder), not a {kind} model",
            hint="drop --device-map, or pass a hub id or a save_pretrained folder",
        )
    out: dict[str, Any] = {"device_map": parse_device_map(device_map)}
    memory = parse_max_memory(max_memory)
    if memory is not None:
        out["max_memory"] = memory
    if offload_folder is not None:
        problem = folder_problem(offload_folder)
        if problem is not None:
            raise ModelLoadError(
                f"--offload-folder {offload_folder}: {problem}", hint="choose a writable folder"
            )
        Path(offload_folder).mkdir(parents=True, exist_ok=True)
        out["offload_folder"] = str(offload_folder)
    return out


def fetch_model(spec: str, *, progress: bool = True) -> tuple[ModelSpec, Path]:
    """Fetch a catalog model (or read a GGUF file) and dequantize it into the cache, without
    loading it (``lensdiv models fetch``): its spec, with where it came from, and its cached
    Hugging Face folder.

    Raises:
        ModelLoadError: ``spec`` names neither a catalog model nor a GGUF file, or the fetch or
            the conversion fails.
    """
    parsed = resolve_spec(spec)
    if parsed.kind not in ("real", "gguf"):
        raise ModelLoadError(
            f"{spec!r} is not a model lensdiv fetches (real models: {', '.join(catalog.CATALOG)})",
            hint="a toy trains on first use (lensdiv toy train NAME); a hub id loads from the hub",
        )
    return _converted(parsed, progress)


def real_status(named: catalog.RealModel) -> str:
    """Where a catalog model is: ``cached`` (dequantized, loads offline), ``fetched`` (its GGUF
    file is here) or ``absent``."""
    if gguf.cached_facts(named.sha256) is not None:
        return "cached"
    return "fetched" if catalog.fetched(named) is not None else "absent"


def _converted(parsed: ModelSpec, progress: bool) -> tuple[ModelSpec, Path]:
    """A GGUF file's or a catalog model's dequantized Hugging Face folder (cached: the file is
    read, or the model fetched, only the first time), and the spec with its origin."""
    if parsed.kind == "real":
        named = catalog.CATALOG[parsed.resolved]
        facts = gguf.cached_facts(named.sha256)
        if facts is None:
            path = catalog.fetch(named, progress=progress)
            facts = gguf.read_facts(path, sha256=named.sha256)
        origin = facts.describe() | {"catalog": named.name, "licence": named.licence}
    else:
        facts = gguf.read_facts(Path(parsed.resolved))
        origin = facts.describe()
    folder = gguf.dequantized(facts, progress=progress)
    return ModelSpec(parsed.spec, parsed.kind, parsed.resolved, origin), folder


def _boot_hf(
    parsed: ModelSpec,
    *,
    device: str,
    dtype: Any,
    trust_remote_code: bool,
    progress: bool = True,
    **placement: Any,
) -> Any:
    where = "local folder" if parsed.kind == "local" else "hub id"
    if parsed.kind == "hub" and not _cached(parsed.resolved):
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        if offline or not _hub_reachable():
            why = "HF_HUB_OFFLINE is set" if offline else "the hub is unreachable"
            raise ModelLoadError(
                f"cannot load model {parsed.spec!r} (hub id {parsed.resolved!r}): {why} and the "
                "model is not in the local Hugging Face cache",
                hint="connect to the internet, or pass a local Hugging Face folder or a built-in "
                "toy model ('toy')",
            )
    import torch
    from transformer_lens import TransformerBridge
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if not progress:  # --no-progress also silences transformers' "Loading weights" bars
        hf_logging.disable_progress_bar()
    try:
        return TransformerBridge.boot_transformers(
            parsed.resolved,
            device=None if placement else device,  # a device map replaces the device
            dtype=dtype or torch.float32,
            trust_remote_code=trust_remote_code,
            **placement,
        )
    except KeyboardInterrupt:
        raise
    except Exception as err:
        reason = _short_reason(err)
        remote = "trust_remote_code" in reason or "custom code" in reason
        hint = (
            "rerun with --trust-remote-code if you trust this model's code"
            if remote and not trust_remote_code
            else "check the name and your connection, or pass a local Hugging Face folder "
            "or a built-in toy model ('toy')"
            if parsed.kind == "hub"
            else "check that the folder holds a complete save_pretrained model and tokenizer"
        )
        raise ModelLoadError(
            f"cannot load model {parsed.spec!r} ({where} {parsed.resolved!r}): {reason}",
            hint=hint,
        ) from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _short_reason(err: Exception) -> str:
    """One readable clause for why Hugging Face / TransformerLens refused a model."""
    text = " ".join(str(err).split())
    lowered = text.lower()
    if "couldn't connect" in lowered or "offline" in lowered or "connection" in lowered:
        return "the hub is unreachable and the model is not in the local Hugging Face cache"
    if (
        "not a valid model identifier" in lowered
        or "repository not found" in lowered
        or "404" in text
    ):
        return "no such model on the Hugging Face hub"
    if "gated" in lowered or "401" in text or "403" in text:
        return "the model is gated: log in with `hf auth login` and accept its licence"
    first = text.split(". ")[0]
    return f"{type(err).__name__}: {first[:200]}"


def _cached(repo_id: str) -> bool:
    """Whether the model's config is already in the local Hugging Face cache."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an odd repo id or cache layout: let the real load decide
        return True


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A DNS lookup of the hub host: without it, huggingface_hub retries for half a minute."""
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or ""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout)
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False
    finally:
        socket.setdefaulttimeout(previous)
