"""The one lens interface and the lenses that run model blocks (docs/science.md C1, P1):
Patchscopes against a naive implementation (one hooked forward pass of the whole inspection
prompt per state) in float64 on GPT-2, Llama (GQA, RoPE), NeoX (parallel) and Gemma-2; the
identity (the prompt's own state patched back gives its output); the last-block lens read
through the interface equal to the old code to the last bit; merges; bf16; the registry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from lensdiv.cli import app
from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.errors import LensError, OptionError
from lensdiv.ops.blocklens import DEFAULT_PROMPT, LastBlockLens, PatchscopeLens
from lensdiv.ops.capture import capture
from lensdiv.ops.inspection import Inspection, inspection
from lensdiv.ops.lens_specs import parse_lens
from lensdiv.ops.prompt import prompt_view
from lensdiv.ops.resume import Resumer
from lensdiv.ops.translators import LENS_KINDS, Lens
from lensdiv.run.merge import merge_runs
from lensdiv.run.runner import analyze
from lensdiv.testing.contract import assert_results_close
from lensdiv.testing.models import boot_tiny, save_softcapped_model, save_tiny_model

ARCHS = ("gpt2", "llama", "neox", "gemma2")
TEXT = "The happy dog ran"


@pytest.fixture(scope="module")
def models64(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The four families in float64 (2-3 blocks each)."""
    from transformer_lens.model_bridge import TransformerBridge

    root = tmp_path_factory.mktemp("patchscope")
    out = {a: boot_tiny(a, save_tiny_model(a, root / a)) for a in ARCHS[:3]}
    gemma = save_softcapped_model(root / "gemma2")
    out["gemma2"] = TransformerBridge.boot_transformers(
        str(gemma), device="cpu", dtype=torch.float32
    ).eval()
    return {a: m.to(torch.float64) for a, m in out.items()}


def naive(model: Any, prompt: str, position: int, start: int, h: torch.Tensor) -> torch.Tensor:
    """One hooked forward pass of the whole inspection prompt per state: ``h`` as block
    ``start``'s input at ``position``; the final residual at the last position."""
    L = int(model.cfg.n_layers)
    tokens = model.to_tokens(prompt, prepend_bos=True, truncate=False)  # BOS first, as data rows
    out = []
    for row in h:
        kept: dict[str, torch.Tensor] = {}

        def patch(t: torch.Tensor, hook: Any, row: torch.Tensor = row) -> torch.Tensor:
            t = t.clone()
            t[:, position] = row.to(t)
            return t

        def keep(t: torch.Tensor, hook: Any, kept: dict = kept) -> torch.Tensor:
            kept["h"] = t[0, -1].clone()
            return t

        site = f"blocks.{start}.hook_resid_pre" if start < L else f"blocks.{L - 1}.hook_resid_post"
        with torch.no_grad(), model.hooks(
            fwd_hooks=[(site, patch), (f"blocks.{L - 1}.hook_resid_post", keep)]
        ):
            model(tokens)
        out.append(kept["h"])
    return torch.stack(out)


def states_of(model: Any, text: str) -> list[torch.Tensor]:
    info = ModelInfo.from_model(model)
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    _, cache = capture(model, model.to_tokens(text), names, need_logits=False)
    return [cache[name][0] for name in names]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("position", "target"), [(-1, "same"), (-4, "same"), (-1, "last"),
                                                  (-2, 1)])
def test_patchscope_equals_one_forward_per_state(models64: dict[str, Any], arch: str,
                                                 position: int, target: Any) -> None:
    model = models64[arch]
    lens = PatchscopeLens(position=position, target=target)
    found = inspection(model, lens.prompt, lens.position)
    assert found.mode == "cache", found.reason  # the fast path, checked on first use
    L = found.n_layers
    states = states_of(model, TEXT)
    rows = torch.arange(states[0].shape[0])
    read = lens.reader(model, None, dtype=torch.float64, device=torch.device("cpu"))
    m = found.tokens.shape[1]
    for layer in range(L + 1):
        got = read(states, layer, rows)
        if layer == L:  # every lens reads h_L as it is
            assert torch.equal(got, states[L])
            continue
        want = naive(model, lens.prompt, position % m, lens.target_layer(layer, L), states[layer])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_prompts_own_state_patched_back_gives_its_output(models64: dict[str, Any],
                                                             arch: str) -> None:
    model = models64[arch]
    for fast in (True, False):
        found = Inspection(model, "The happy dog ran to the", -1, fast=fast)
        assert found.mode == ("cache" if fast else "rerun")
        out = found.clean[found.n_layers][-1]
        for start in range(found.n_layers + 1):
            got = found.run(start, found.clean[start][-1][None])[0]
            torch.testing.assert_close(got, out, rtol=0, atol=1e-9 * float(out.abs().max()))


@pytest.mark.parametrize(("arch", "position"), [("llama", -1), ("gpt2", -4)])
@pytest.mark.parametrize("limit", [0, 3, 8, 512])
def test_sweeps_read_each_block_once_for_the_starts_they_hold(
    models64: dict[str, Any], monkeypatch: Any, arch: str, position: int, limit: int
) -> None:
    """``run_each`` gives what ``run`` gives start by start, and runs a block once for all the
    starts of a sweep: a sweep holds at most ``SWEEP_ROWS`` rows, a start more than half of them
    runs alone."""
    from lensdiv.ops import inspection as inspection_module
    from lensdiv.ops.purelayers import LayerCalls

    model = models64[arch]
    found = Inspection(model, DEFAULT_PROMPT, position)
    assert found.layers == "shared prefix", found.layers_reason
    L, n = found.n_layers, 3
    generator = torch.Generator().manual_seed(1)
    scale = float(found.clean[1].std())
    by_start = {
        start: torch.randn(n, found.clean[0].shape[-1], generator=generator, dtype=torch.float64)
        * scale
        for start in range(L)
    }
    want = {start: found.run(start, h) for start, h in by_start.items()}
    monkeypatch.setattr(inspection_module, "SWEEP_ROWS", limit)
    calls: list[int] = []
    step = LayerCalls.step

    def counted(self: Any, layers: Any, index: int, x: torch.Tensor, cache: Any) -> torch.Tensor:
        calls.append(int(x.shape[0]))
        return step(self, layers, index, x, cache)

    monkeypatch.setattr(LayerCalls, "step", counted)
    got = found.run_each(by_start)
    for start in range(L):
        torch.testing.assert_close(got[start], want[start], rtol=0,
                                   atol=1e-12 * float(want[start].abs().max()))
    per_start = L * (L + 1) // 2  # Σ (L − ℓ) block calls, one start at a time
    if limit < 2 * n:  # no two starts fit in a call: each runs alone
        assert len(calls) == per_start and set(calls) == {n}
    else:
        assert max(calls) <= limit and sum(calls) == n * per_start  # the same rows, fewer calls
        firsts = range(0, L, limit // n)  # the sweeps: limit // n starts each, in order
        assert len(calls) == sum(L - first for first in firsts) < per_start, calls


@pytest.mark.parametrize(("arch", "position"), [("llama", -1), ("gpt2", -3)])
def test_the_prefix_held_in_place_survives_calls_of_other_sizes(models64: dict[str, Any],
                                                                arch: str, position: int) -> None:
    """The prefix's keys and values are copied once into buffers the continuations write their
    own tokens into: a call with fewer rows, other rows or another start in between changes no
    later answer, and they equal the cache that copies the prefix per call."""
    model = models64[arch]
    found = Inspection(model, DEFAULT_PROMPT, position)
    assert found.mode == "cache", found.reason
    kinds = {type(layer).__name__ for layer in found._cache(2).layers}
    assert kinds == {"Prefixed"}, kinds  # full attention: no copy of the prefix per call
    generator = torch.Generator().manual_seed(0)
    scale = float(found.clean[2].std())
    big = torch.randn(9, found.clean[0].shape[-1], generator=generator) * scale
    first = found.run(2, big)
    found.run(1, big[:3] * 2)
    found.run(2, big[5:] - 1)
    torch.testing.assert_close(found.run(2, big), first, rtol=0, atol=0)
    want = naive(model, DEFAULT_PROMPT, found.position, 2, big)
    torch.testing.assert_close(first, want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("arch", ["llama", "native"])
def test_what_the_model_says_about_a_state(models64: dict[str, Any], native_model: Any,
                                           arch: str) -> None:
    """The greedy continuation with a state patched in: the prompt's own clean state patched
    back continues the prompt as the model does; another state's first token is the argmax
    of its patchscope readout (the naive loop's final residual through the final norm and the
    unembedding), and each probability is that token's softmax there."""
    model = native_model if arch == "native" else models64[arch]
    found = Inspection(model, DEFAULT_PROMPT, -1)
    L = found.n_layers
    tokens = found.tokens
    own = []
    with torch.no_grad():
        for _ in range(4):
            probs = torch.softmax(model(tokens, return_type="logits")[0, -1].float(), -1)
            own.append(int(probs.argmax()))
            tokens = torch.cat([tokens, tokens.new_tensor([[own[-1]]])], dim=1)
    for start in (0, L // 2, L):
        said, _ = found.generate(start, found.clean[start][-1], 4)
        assert said == own, (start, said, own)
    h = states_of(model, TEXT)[1][2]
    said, probs = found.generate(1, h, 3)
    final = naive(model, DEFAULT_PROMPT, found.position, 1, h[None])
    with torch.no_grad():
        logits = model.unembed(model.ln_final(final[None]))[0, 0].float()
    assert said[0] == int(logits.argmax())
    assert probs[0] == pytest.approx(float(torch.softmax(logits, -1).max()), rel=1e-4)
    assert len(said) == len(probs) == 3 and all(0 < p <= 1 for p in probs)
    with pytest.raises(LensError, match="at least one token"):
        found.generate(1, h, 0)


def test_a_tl_native_model_runs_the_whole_prompt(native_model: Any) -> None:
    found = inspection(native_model, DEFAULT_PROMPT, -1)
    assert found.mode == "rerun" and "KV cache" in found.reason
    states = states_of(native_model, TEXT)
    rows = torch.arange(3)
    got = PatchscopeLens().read_all(found, states, rows)[1]
    want = naive(native_model, DEFAULT_PROMPT, found.position, 1, states[1][:3])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _old_through_last_block(model: Any, tokens: torch.Tensor, states: list) -> list:
    """The prompt view's last-block rows before the lens interface (kept as the reference)."""
    L = len(states)
    out: dict[str, torch.Tensor] = {}

    def keep(tensor: torch.Tensor, *, hook: Any) -> torch.Tensor:
        out["h"] = tensor.detach()
        return tensor

    Resumer(model).run(tokens.repeat(L - 1, 1), L - 1, torch.cat(list(states[:-1])),
                       [(f"blocks.{L - 1}.hook_resid_post", keep)], logits=False)
    final = f"blocks.{L - 1}.hook_resid_post"
    _, last = capture(model, tokens, [final], need_logits=False)
    return [*list(out["h"]), last[final][0]]


def test_last_block_through_the_interface_is_bit_for_bit_the_old_one(model: Any) -> None:
    info = ModelInfo.from_model(model)
    tokens = model.to_tokens(TEXT)
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    with torch.no_grad():
        _, clean = capture(model, tokens, names, need_logits=False)
        old = _old_through_last_block(model, tokens, [clean[n] for n in names[:-1]])
        read = LastBlockLens().reader(model, tokens, dtype=torch.float32,
                                      device=torch.device("cpu"))
        every = torch.arange(tokens.shape[1])
        flat = [clean[n][0] for n in names]
        new = [read(flat, layer, every) for layer in LastBlockLens().shown(info.n_layers)]
    assert len(new) == len(old) == info.n_layers
    for a, b in zip(new, old, strict=True):
        assert torch.equal(a, b)


def test_every_lens_reading_analyzer_takes_block_lenses(tiny_dirs: dict[str, Path]) -> None:
    """lens, dynamics and bias (states) through last-block and patchscope."""
    spec = dict(data="text:" + "the cat sat on the mat and the dog ran home. " * 4,
                max_tokens=96, seq_len=32, progress=False)
    opts = {"bias": {"members": "states", "every": "1"}, "dynamics": {"every": "1"}}
    for name in ("last-block", "patchscope"):
        run = analyze(str(tiny_dirs["gpt2"]), plugins="lens,dynamics,bias", options=opts,
                      lens=name, **spec)
        assert not run.errors, run.errors
        assert run.manifest["lens"]["kind"] == name
        kl = run["lens"].table()["kl"]
        assert kl[-1] == 0 and all(k >= 0 for k in kl)
        assert run["lens"].meta["lens"]["kind"] == name
        columns = [c for table in run["dynamics"].tables.values() for c in table.columns]
        assert f"{name}_lens_ce" in columns, columns
        assert run["bias"].meta is not None
    lb = analyze(str(tiny_dirs["gpt2"]), plugins="lens", lens="last-block", **spec)
    assert lb["lens"].table()["kl"][-2] == 0  # h_{L-1} through the last block is h_L


def test_merged_shards_equal_one_run_through_the_patchscope(tiny_dirs: dict[str, Path],
                                                            tmp_path: Path) -> None:
    spec = dict(data="text:" + "a b c d e f g h i j k l m n o p. " * 8, max_tokens=24 * 5,
                seq_len=24, batch_size=2, progress=False, lens="patchscope:target=last")
    one = analyze(str(tiny_dirs["llama"]), plugins="lens", **spec)
    for index in range(2):
        analyze(str(tiny_dirs["llama"]), plugins="lens", out=tmp_path / f"s{index}",
                shard=f"{index}/2", **spec)
    merged = merge_runs([tmp_path / "s1", tmp_path / "s0"], tmp_path / "all")
    assert_results_close(merged["lens"], one["lens"], rtol=1e-6, what="lens")
    manifest = json.loads((tmp_path / "all" / "manifest.json").read_text())
    assert manifest["lens"]["target"] == "last" and manifest["lens"]["prompt"] == DEFAULT_PROMPT


def test_bf16_model_float32_readout(tiny_dirs: dict[str, Path]) -> None:
    from transformer_lens.model_bridge import TransformerBridge

    model = TransformerBridge.boot_transformers(str(tiny_dirs["llama"]), device="cpu",
                                                dtype=torch.bfloat16).eval()
    view = prompt_view(model, TEXT, lens="patchscope")
    assert view.meta["readout_dtype"] == "float32" and view.meta["model_dtype"] == "bfloat16"
    assert inspection(model, DEFAULT_PROMPT, -1).mode == "cache"
    probs = torch.tensor(view.top_probs)
    assert torch.isfinite(probs).all() and (probs > 0).all()


def test_options_and_their_mistakes(tmp_path: Path) -> None:
    prompt = tmp_path / "p.txt"
    prompt.write_text("x -> x; y -> y; ?\n")
    lens = parse_lens(f"patchscope:prompt_file={prompt}&position=-2&target=3")
    assert isinstance(lens, PatchscopeLens)
    assert (lens.prompt, lens.position, lens.target) == ("x -> x; y -> y; ?", -2, 3)
    assert parse_lens(lens.spec).describe() == lens.describe()
    assert parse_lens("patchscope").describe()["prompt"] == DEFAULT_PROMPT
    for bad in ("patchscope:colour=red", "patchscope:target=middle", "patchscope:position=x",
                f"patchscope:prompt_file={tmp_path / 'none'}", "last-block:x"):
        with pytest.raises(LensError):
            parse_lens(bad)


def test_bad_target_and_position_are_one_line(native_model: Any) -> None:
    with pytest.raises(LensError, match="target block"):
        prompt_view(native_model, TEXT, lens="patchscope:target=9")
    with pytest.raises(LensError, match="outside"):
        prompt_view(native_model, TEXT, lens="patchscope:position=999")
    with pytest.raises(OptionError, match="logit lens only"):
        prompt_view(native_model, TEXT, lens="patchscope", skip=0)


def test_every_lens_is_a_kind_in_the_registry() -> None:
    for name in ("logit", "last-block", "patchscope"):
        made = LENS_KINDS[name].build()
        assert isinstance(made, Lens) and made.kind == name and made.lens_kind is LENS_KINDS[name]
        assert parse_lens(name).kind == name


def test_fitters_do_not_depend_on_what_was_imported() -> None:
    """The registry names each fitter by import path: asked for first thing in a fresh
    process, before lensdiv.lenses is imported, it is there."""
    code = (
        "import sys; from lensdiv.ops.translators import LENS_KINDS, fitted_kinds\n"
        "assert 'lensdiv.lenses.fit' not in sys.modules\n"
        "assert fitted_kinds() == ['tuned', 'jacobian', 'affine'], fitted_kinds()\n"
        "f = LENS_KINDS['tuned'].fitting(); print(type(f).__name__, f.artifact)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split()[0] == "TunedFitter"


def test_cli_shows_patchscope_beside_the_logit_lens(tiny_dirs: dict[str, Path]) -> None:
    result = CliRunner().invoke(app, ["lens", str(tiny_dirs["gpt2"]), TEXT,
                                      "--lens", "logit,patchscope"])
    assert result.exit_code == 0, result.output
    assert "Logit lens" in result.output and "Patchscope lens" in result.output
    bad = CliRunner().invoke(app, ["lens", str(tiny_dirs["gpt2"]), TEXT,
                                   "--lens", "patchscope:colour=red"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def test_the_sweep_diagonal_is_the_lens_through_patchscope(tiny_dirs: dict[str, Path]) -> None:
    """The (source × target) sweep: its diagonal is `lens --lens patchscope`, its last column
    `--lens patchscope:target=last`, on the same positions."""
    spec = dict(data="text:" + "the cat sat on the mat and the dog ran home. " * 4,
                max_tokens=64, seq_len=32, progress=False)
    sweep = analyze(str(tiny_dirs["llama"]), plugins="patchscope",
                    options={"patchscope": {"every": "1", "exclude_bos": "false"}}, **spec)
    assert not sweep.errors, sweep.errors
    kl, ce = sweep["patchscope"].arrays["kl"], sweep["patchscope"].arrays["ce"]
    L = kl.shape[0]
    same = analyze(str(tiny_dirs["llama"]), plugins="lens", lens="patchscope", **spec)
    last = analyze(str(tiny_dirs["llama"]), plugins="lens", lens="patchscope:target=last", **spec)
    torch.testing.assert_close(torch.tensor(kl.diagonal()),
                               torch.tensor(same["lens"].table()["kl"][:L]), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(torch.tensor(ce[:, L - 1]),
                               torch.tensor(last["lens"].table()["ce"][:L]), rtol=1e-6, atol=1e-9)
    top1 = sweep["patchscope"].arrays["top1"]
    assert ((top1 >= 0) & (top1 <= 1)).all()
    assert len(sweep["patchscope"].plots) == 3


def test_a_fast_path_that_fails_warns_once(models64: dict[str, Any], monkeypatch: Any) -> None:
    """A Hugging Face model whose cached continuation fails runs the exact slow path and says so,
    once per process and reason (not silently: it costs about the prompt's length in work)."""
    from lensdiv.ops import kvcache

    def broken(self: Any) -> bool:
        raise RuntimeError("a cache this transformers does not fill")

    monkeypatch.setattr(Inspection, "_probe_tuple", broken)
    monkeypatch.setattr(kvcache, "_WARNED", set())
    model = models64["llama"]
    with pytest.warns(kvcache.FallbackWarning, match="slow path.*does not fill"):
        found = Inspection(model, DEFAULT_PROMPT, -1)
    assert found.mode == "rerun" and "does not fill" in found.reason
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", kvcache.FallbackWarning)
        assert Inspection(model, DEFAULT_PROMPT, -2).mode == "rerun"  # said already: quiet


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_cache_reaches_every_attention_bridge(models64: dict[str, Any], arch: str) -> None:
    """Whatever the installed transformers calls its cache argument (``cache`` from 5.24,
    ``past_key_values`` before), the prefix's keys and values are written: the fast path holds."""
    from lensdiv.ops.kvcache import cache_kwargs, passing_cache

    model = models64[arch]
    tokens = model.to_tokens("The happy dog")
    with torch.no_grad(), passing_cache(model):
        _, cache = model(tokens, return_type="logits_and_cache")
    assert all(layer.keys is not None and layer.keys.shape[-2] == tokens.shape[1]
               for layer in cache.layers)
    (name,) = cache_kwargs(model, cache)
    assert name in ("cache", "past_key_values")


def test_the_inspection_prompt_starts_with_bos_as_data_rows_do(models64: dict[str, Any],
                                                               monkeypatch: Any) -> None:
    """A bridge whose default is not to prepend BOS (NeoX's) still reads the inspection prompt
    with it, as the data rows and the prompt view have it: the same text as a source and as the
    inspection prompt is one sequence, so the same-prompt identity holds exactly."""
    model = models64["neox"]
    monkeypatch.setattr(model.cfg, "default_prepend_bos", False)
    found = Inspection(model, TEXT, -1)
    want = model.to_tokens(TEXT, prepend_bos=True)
    assert found.tokens_list == [int(t) for t in want[0]]
    assert found.tokens_list[0] == model.tokenizer.bos_token_id
    info = ModelInfo.from_model(model)
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    _, cache = capture(model, want, names, need_logits=False)
    out = cache[names[-1]][0, -1]
    for start in range(info.n_layers + 1):
        got = found.run(start, cache[names[start]][0, -1][None])[0]
        torch.testing.assert_close(got, out, rtol=0, atol=1e-9 * float(out.abs().max()))


def test_a_quoted_prompt_keeps_its_commas_and_ampersands(models64: dict[str, Any]) -> None:
    """``prompt="a, b & c"`` is one prompt, in a patchscope spec and in a list of lenses; an
    unquoted one says how to quote it."""
    lens = parse_lens('patchscope:prompt="x -> x, y & z -> ?"&position=-1')
    assert lens.prompt == "x -> x, y & z -> ?"
    view = prompt_view(models64["gpt2"], TEXT, lens="logit,patchscope:prompt='a -> a, b -> ?'")
    assert len(view) == 2 and "a -> a, b -> ?" in json.dumps(view[1].to_dict())
    with pytest.raises(OptionError, match="quote"):
        prompt_view(models64["gpt2"], TEXT, lens="logit,patchscope:prompt=a -> a, b -> ?")


def test_a_position_outside_the_prompt_is_refused_before_the_run(models64: dict[str, Any],
                                                                  tmp_path: Path) -> None:
    with pytest.raises(LensError, match="position 99 is outside.*use a position from"):
        analyze(models64["gpt2"], data="text:" + TEXT * 4, plugins="lens",
                lens="patchscope:position=99", out=tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "manifest.json").exists()  # refused before anything ran
