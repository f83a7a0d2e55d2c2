"""Toy models and synthetic corpora: determinism, splits, training, the verified cache, the CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from lensdiv.cli import app
from lensdiv.core.errors import ModelLoadError
from lensdiv.data.corpus import (
    CORPUS_VERSION,
    MAX_HOPS,
    RELATIONS,
    KnowledgeBase,
    language_documents,
    mixed_documents,
)
from lensdiv.models.toy import (
    TOY_VERSION,
    ToySpec,
    TrainRecipe,
    entry_dir,
    load_toy,
    parse_toy,
    recipe_key,
    train_toy,
    verify_entry,
    zoo,
)

TINY = TrainRecipe(steps=12, batch_size=4, seq_len=64, warmup=2, eval_every=6, eval_tokens=512,
                   hop_queries=8)
SPEC = ToySpec(depth=1, width=32)


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LENSDIV_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def digest(docs) -> str:
    return hashlib.sha256("\x00".join(docs).encode()).hexdigest()


def test_corpus_is_byte_identical_for_a_seed() -> None:
    for make in (lambda s: mixed_documents(seed=s), lambda s: language_documents(s)):
        first = digest(itertools.islice(make(0), 200))
        assert digest(itertools.islice(make(0), 200)) == first
        assert digest(itertools.islice(make(1), 200)) != first


def test_train_and_test_documents_differ() -> None:
    train = set(itertools.islice(mixed_documents(split="train"), 300))
    test = set(itertools.islice(mixed_documents(split="test"), 300))
    assert not train & test


def test_knowledge_base_answers_follow_the_facts() -> None:
    kb = KnowledgeBase(seed=3)
    for hops in range(1, MAX_HOPS + 1):
        for q in itertools.islice(kb.queries("train", hops), 20):
            entity = q.start
            for relation in q.relations:
                entity = kb.facts[(relation, entity)]
            assert q.answer == entity and q.hops == hops
            assert q.prompt.count("(") == hops and q.text.endswith(f"={q.answer};")
            assert q.relations[0] in RELATIONS


def test_held_out_chains_never_appear_in_training() -> None:
    kb = KnowledgeBase(seed=0)
    for hops in range(2, MAX_HOPS + 1):
        train = {(q.relations, q.start) for q in itertools.islice(kb.queries("train", hops), 400)}
        test = {(q.relations, q.start) for q in itertools.islice(kb.queries("test", hops), 400)}
        assert test and train and not train & test
    # and the training documents contain no held-out query text
    held_out = {q.text for h in range(2, MAX_HOPS + 1) for q in itertools.islice(kb.queries("test", h), 200)}
    docs = " ".join(itertools.islice(kb.documents("train"), 500))
    assert not any(text in docs for text in held_out)


@pytest.mark.parametrize("name,depth,width", [("toy", 4, 64), ("toy:d8", 8, 64),
                                              ("toy:d2-w128", 2, 128)])
def test_parse_toy(name: str, depth: int, width: int) -> None:
    spec = parse_toy(name)
    assert (spec.depth, spec.width) == (depth, width)


@pytest.mark.parametrize("name", ["toy:", "toy:d0", "toy:d4-w20", "toy:w64", "tiny"])
def test_bad_toy_names(name: str) -> None:
    with pytest.raises(ModelLoadError):
        parse_toy(name)


def test_recipe_key_changes_with_the_recipe() -> None:
    assert recipe_key(SPEC, TINY) != recipe_key(SPEC, TrainRecipe(steps=13))
    assert recipe_key(SPEC, TINY) != recipe_key(ToySpec(depth=2, width=32), TINY)
    assert recipe_key(SPEC, TINY) != recipe_key(SPEC, dataclasses.replace(TINY, kb_fraction=1.0))
    assert recipe_key(SPEC, TINY) != recipe_key(dataclasses.replace(SPEC, task="kb"), TINY)


def test_fields_added_later_keep_old_cache_keys() -> None:
    """Models cached before ``kb_fraction``, ``kb_hops`` and ``task`` existed keep their keys."""
    later = ("kb_fraction", "kb_hops")
    old = {k: v for k, v in dataclasses.asdict(TrainRecipe()).items() if k not in later}
    spec = {k: v for k, v in dataclasses.asdict(ToySpec()).items() if k != "task"}
    blob = json.dumps({"spec": spec, "recipe": old, "corpus": CORPUS_VERSION, "toy": TOY_VERSION},
                      sort_keys=True)  # fmt: skip
    assert recipe_key(ToySpec(), TrainRecipe()) == hashlib.sha256(blob.encode()).hexdigest()[:12]


def test_multihop_toy_spec_and_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_toy("toy:kb")
    assert spec.name == "toy:kb" and spec.task == "kb" and spec in zoo()
    monkeypatch.delenv("LENSDIV_TOY_STEPS", raising=False)
    recipe = TrainRecipe.default(spec)
    assert recipe == TrainRecipe.multihop() and recipe.kb_fraction == 1.0
    assert recipe.steps > TrainRecipe().steps  # trained longer than the zoo
    assert TrainRecipe.default(ToySpec()) == TrainRecipe()
    monkeypatch.setenv("LENSDIV_TOY_STEPS", "7")
    short = TrainRecipe.default(spec)
    assert short.steps == 7 and short.kb_fraction == recipe.kb_fraction  # still the kb mix
    assert entry_dir(spec).name.startswith("toy-kb-")


def test_kb_only_mix_has_no_language_documents() -> None:
    docs = list(itertools.islice(mixed_documents(kb_fraction=1.0), 50))
    assert all("=" in d and ";" in d and "." not in d for d in docs)


def test_train_cache_and_reload(cache: Path) -> None:
    model, log = train_toy(SPEC, TINY, progress=False)
    folder = entry_dir(SPEC, TINY)
    assert folder.is_dir() and verify_entry(folder) is None
    assert (folder / "loss.png").is_file()
    saved = json.loads((folder / "train_log.json").read_text())
    assert saved["heldout_loss"] == log["heldout_loss"]
    assert len(saved["train_loss"]) == TINY.steps
    assert set(saved["multihop"]) == {"chance", "baseline", "1", "2", "3", "4"}
    assert all(0.0 <= saved["multihop"][str(h)] <= 1.0 for h in range(1, 5))
    # The prior baseline (best answer ignoring the start entity) beats 1/entities.
    baseline = saved["multihop"]["baseline"]
    assert set(baseline) == {"1", "2", "3", "4"}
    assert all(saved["multihop"]["chance"] < baseline[h] < 1 for h in baseline)
    assert len(saved["lens_kl"]) == SPEC.depth + 1 and saved["lens_kl"][-1] == pytest.approx(0, abs=1e-6)
    # training lowers the loss from its value at initialisation (log 260 for a uniform guess)
    assert saved["heldout_loss"] < saved["train_loss"][0]
    reloaded = load_toy(SPEC.name, recipe=TINY, progress=False)
    tokens = torch.randint(4, 260, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(tokens), reloaded(tokens))


def test_training_is_reproducible(cache: Path) -> None:
    _, first = train_toy(SPEC, TINY, progress=False, save=False)
    _, second = train_toy(SPEC, TINY, progress=False, save=False)
    assert abs(first["heldout_loss"] - second["heldout_loss"]) <= 0.01 * first["heldout_loss"]


@pytest.mark.parametrize("damage", ["flip_weights", "drop_marker", "truncate_weights"])
def test_corrupt_or_partial_cache_is_retrained(cache: Path, damage: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    model, _ = train_toy(SPEC, TINY, progress=False)
    folder = entry_dir(SPEC, TINY)
    weights = folder / "weights.pt"
    if damage == "flip_weights":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "drop_marker":
        (folder / "COMPLETE.json").unlink()
    else:
        weights.write_bytes(weights.read_bytes()[:100])
    assert verify_entry(folder) is not None
    reloaded = load_toy(SPEC.name, recipe=TINY, progress=False)
    assert "retraining" in capsys.readouterr().err
    assert verify_entry(folder) is None
    tokens = torch.randint(4, 260, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(tokens), reloaded(tokens))  # same seed, same recipe


def test_toy_cli(cache: Path) -> None:
    runner = CliRunner()
    listing = runner.invoke(app, ["toy", "list"])
    assert listing.exit_code == 0 and "toy:d8-w64" in listing.output and "no" in listing.output
    trained = runner.invoke(app, ["toy", "train", "toy:d1-w32", "--no-progress"])
    assert trained.exit_code == 0, trained.output
    assert "held-out loss" in trained.output and "1 hop" in trained.output
    both = runner.invoke(app, ["toy", "train", "toy:d1", "--all"])
    assert both.exit_code == 2 and "--all" in both.output
    bad = runner.invoke(app, ["toy", "train", "toy:dx"])
    assert bad.exit_code == 2 and "bad toy model spec" in bad.output
