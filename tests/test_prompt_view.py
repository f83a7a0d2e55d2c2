"""The prompt view: identities of its readout on every architecture, float32 on a bf16 model,
the last-block lens and skip, rendering (terminal, text, notebook, HTML, PNG), the command."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import lensdiv
from lensdiv.cli import app
from lensdiv.core.errors import OptionError
from lensdiv.ops.prompt import float32_readout, prompt_view
from lensdiv.ops.token_text import token_text
from lensdiv.testing.models import boot_native_tiny
from lensdiv.view.prompt import PromptView

TEXT = "The happy dog knows"


def model_output(model: Any, view: PromptView) -> torch.Tensor:
    tokens = model.to_tokens(TEXT, prepend_bos=True)
    with torch.no_grad():
        return model(tokens)[0].float().softmax(-1)


def test_top_row_is_the_models_output(model: Any) -> None:
    """At h_L the lens is the model's own output: same top-k and probabilities, KL = 0."""
    view = prompt_view(model, TEXT, top_k=3)
    L = model.cfg.n_layers
    assert list(view.rows) == [f"h{layer}" for layer in range(L + 1)]
    assert len(view.tokens) == model.to_tokens(TEXT, prepend_bos=True).shape[1]
    probs = model_output(model, view)
    top = probs.topk(3, dim=-1)
    np.testing.assert_allclose(view.top_probs[-1], top.values.numpy(), rtol=1e-4, atol=1e-6)
    # the token's text (a byte without one as <0xC3>: lensdiv.ops.token_text)
    assert view.top_tokens[-1][0][0] == token_text(model.tokenizer, int(top.indices[0, 0]))
    assert max(view.kl[-1]) < 1e-5
    assert min(min(row) for row in view.kl) >= 0
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    np.testing.assert_allclose(view.entropy[-1], entropy.numpy(), rtol=1e-4, atol=1e-5)
    # The next token's probability and rank agree with the top-k where it is among them.
    tokens = model.to_tokens(TEXT, prepend_bos=True)[0]
    for t in range(len(view.tokens) - 1):
        want = float(probs[t, tokens[t + 1]])
        assert view.next_prob[-1][t] == pytest.approx(want, rel=1e-4, abs=1e-7)
        assert (view.next_rank[-1][t] == 0) == (int(top.indices[t, 0]) == int(tokens[t + 1]))
    assert math.isnan(view.next_prob[-1][-1]) and view.next_rank[-1][-1] == -1


def test_readout_is_float32_on_a_bf16_model() -> None:
    model = boot_native_tiny()
    reference = prompt_view(model, TEXT)
    low = boot_native_tiny().to(torch.bfloat16)
    assert next(low.parameters()).dtype == torch.bfloat16
    read, how = float32_readout(low)
    h = torch.randn(3, low.cfg.d_model, dtype=torch.bfloat16)
    assert read(h).dtype == torch.float32 and "float32" in how
    view = prompt_view(low, TEXT)
    assert view.meta["readout_dtype"] == "float32" and view.meta["model_dtype"] == "bfloat16"
    # The same prediction as the float32 model, up to the bf16 forward pass.
    assert view.top_tokens[-1] == reference.top_tokens[-1] or np.allclose(
        view.top_probs[-1], reference.top_probs[-1], atol=5e-2)
    np.testing.assert_allclose(view.top_probs[-1], reference.top_probs[-1], atol=5e-2)
    assert max(view.kl[-1]) < 1e-5  # the top row is the bf16 model's own output, read in fp32


def test_last_block_lens_ends_at_the_output(native_model: Any) -> None:
    view = prompt_view(native_model, TEXT, lens="last-block")
    L = native_model.cfg.n_layers
    assert len(view.rows) == L and view.lens == "last-block"
    assert max(view.kl[-1]) < 1e-4
    logit = prompt_view(native_model, TEXT)
    np.testing.assert_allclose(view.top_probs[-1], logit.top_probs[-1], rtol=1e-4, atol=1e-6)


def test_skip_changes_only_later_rows(native_model: Any) -> None:
    clean = prompt_view(native_model, TEXT)
    skipped = prompt_view(native_model, TEXT, skip=1)
    assert skipped.lens == "skip" and skipped.meta["skip"] == 1
    for row in (0, 1):  # h_0, h_1: before block 1, untouched
        np.testing.assert_allclose(skipped.top_probs[row], clean.top_probs[row], rtol=1e-5)
    # h_2 = h_1 at every position but the first: the row repeats h_1's predictions there.
    np.testing.assert_allclose(np.asarray(skipped.top_probs[2])[1:],
                               np.asarray(clean.top_probs[1])[1:], rtol=1e-5)
    assert max(skipped.kl[-1][1:]) > 1e-6  # the output moved...
    assert skipped.kl[-1][0] < 1e-5  # ...but not at the untouched first position
    attn = prompt_view(native_model, TEXT, skip=1, part="attn")
    assert attn.meta["part"] == "attn" and max(attn.kl[-1][1:]) > 1e-6


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"top_k": 0}, "top-k"), ({"lens": "tuned"}, "lens"), ({"skip": 99}, "blocks"),
    ({"skip": 0, "lens": "last-block"}, "logit lens"), ({"part": "norm", "skip": 0}, "part"),
])
def test_bad_options_are_one_line_errors(native_model: Any, kwargs: dict, needle: str) -> None:
    with pytest.raises(OptionError, match=needle):
        prompt_view(native_model, TEXT, **kwargs)


def test_renders_everywhere(native_model: Any, tmp_path: Path) -> None:
    view = prompt_view(native_model, "a <b>bold</b> & x", top_k=2)
    text = str(view)
    assert "Logit lens" in text and "h0" in text and "\x1b[" not in text
    bundle = view._repr_mimebundle_()
    assert bundle["text/plain"] == text
    html = bundle["text/html"]
    assert "pv-tip" in html and "KL to the output" in html and "entropy" in html
    assert "<b>bold</b>" not in html and "&lt;b&gt;" in html  # tokens are text, never markup
    page = view.save(tmp_path / "view.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "http://" not in page and "https://" not in page
    png = view.save(tmp_path / "view.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    back = PromptView.load(view.save(tmp_path / "view.json"))
    assert json.dumps(back.to_dict()) == json.dumps(view.to_dict())
    fig, ax = view.figure()
    assert [t.get_text() for t in ax.get_xticklabels()][0] == "<bos>"
    assert ax.images[0].colorbar.ax.get_ylabel() == "top-1 probability"
    assert list(ax.get_yticks()) == list(range(len(view.rows)))


def test_python_api_is_exported() -> None:
    assert lensdiv.prompt_view is prompt_view and lensdiv.PromptView is PromptView


def test_command_prints_and_writes(tmp_path: Path) -> None:
    runner = CliRunner()
    page = tmp_path / "view.html"
    result = runner.invoke(app, ["lens", "toy", TEXT, "--top-k", "2", "--html", str(page)],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "Logit lens" in result.output and "h4" in result.output
    assert page.is_file() and page.with_suffix(".png").is_file()
    assert "pv-cell" in page.read_text()
    for args, needle in ((["--skip", "9"], "blocks"), (["--lens", "tuned"], "lens"),
                         (["--top-k", "0"], "top-k")):
        bad = runner.invoke(app, ["lens", "toy", TEXT, *args])
        assert bad.exit_code == 2 and bad.output.startswith("error:"), bad.output
        assert len(bad.output.strip().splitlines()) == 1 and needle in bad.output
    empty = runner.invoke(app, ["lens", "toy", "  "])
    assert empty.exit_code == 2 and "empty" in empty.output


def test_a_prompt_longer_than_the_context_is_refused_not_cut(native_model: Any) -> None:
    """TransformerBridge.to_tokens cuts a long prompt to n_ctx by default: the prompt view asks
    for every token and refuses what the model cannot read, naming both lengths."""
    from lensdiv.core.errors import DataError

    n_ctx = int(native_model.cfg.n_ctx)
    text = "a" * (n_ctx + 5)
    with pytest.raises(DataError, match=f"at most {n_ctx}"):
        prompt_view(native_model, text)
    assert len(prompt_view(native_model, "a" * 3).tokens) <= n_ctx
