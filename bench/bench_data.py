"""Benchmark: the data path (read, tokenise, pack) alone, and whether it overlaps the model.

Two parts, each in one process, cases interleaved, best of ``--repeats`` after a warm-up:

1. **Data path alone**, tokens/s, on the built-in corpus, for two fast tokenizers built here
   with no download: lensdiv's byte tokenizer (the toy models') and a GPT-2-style byte-level BPE
   (GPT-2's pre-tokenizer and byte alphabet, merges trained on the built-in corpus). Cases:

   - ``before``: packing as lensdiv 0.1 did it (:func:`pack_one_at_a_time`, copied here: one
     tokenizer call per document, rows as Python lists of ``(token, document)`` tuples);
   - ``after``: :func:`lensdiv.data.packing.pack` (chunks of documents, one batched tokenizer
     call each, rows cut with numpy), checked to give the same batches bit for bit;
   - ``after, read ahead``: what the runner iterates, the same on a background thread
     (:func:`lensdiv.data.prefetch.ready_batches`);
   - ``after, cached``: :func:`lensdiv.data.sources.token_batches` of the same spec (the
     built-in corpus, the same documents) from a warm token cache (:mod:`lensdiv.data.cache`:
     ids read from disk, no tokenizer call), checked to give the same batches bit for bit;
   - ``tokenizer alone``: one batched call over the same documents, nothing else (the ceiling
     of any packing);
   - ``packing alone``: :func:`~lensdiv.data.packing.pack` with the ids already known.

   Wall-clock tokens/s, and tokens per CPU second of the process (all its threads; steadier on
   a shared machine). Every case but ``after, cached`` runs with the token cache off.

2. **Overlap**: a run (``analyze``, ``lens`` on a random GPT-2-shaped model) whose tokenizer is
   made slow — it sleeps in every call in proportion to the characters it is given, like a
   tokenizer working off the interpreter's lock, calibrated so that the data alone takes about
   as long as the model alone. Cases: ``compute`` (the same run on the same batches given as a
   token tensor: no tokenising), ``data`` (iterating the slow data path alone), ``run, serial``
   (reading ahead switched off: ``lensdiv.data.prefetch.DEPTH = 0``) and ``run, overlapped``
   (as shipped). Overlap means ``run / max(data, compute)`` near 1, not
   ``run / (data + compute)``. The token cache is off (``LENSDIV_TOKEN_CACHE=off``): the
   data path tokenises in every case, as a first run does.

    python bench/bench_data.py [--tokens 1000000 --repeats 3 --json bench/data_cpu.json]
    python bench/bench_data.py --device cuda --overlap-tokens 262144   # part 2's model on a GPU
"""

from __future__ import annotations

import argparse
import atexit
import copy
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from common import add_device, best_of, build, device_name, place, report

import lensdiv.data.prefetch as prefetch
from lensdiv import analyze
from lensdiv.core.analyzer import Batch
from lensdiv.core.errors import DataError
from lensdiv.data.cache import ENV as CACHE_ENV
from lensdiv.data.corpus import builtin_documents
from lensdiv.data.packing import pack
from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.data.tokenizer import byte_tokenizer

_R = TypeVar("_R")
# The token cache of the "after, cached" case: a fresh folder, removed at exit.
CACHE_DIR = tempfile.mkdtemp(prefix="lensdiv-bench-tokens-")
atexit.register(shutil.rmtree, CACHE_DIR, ignore_errors=True)


def pack_one_at_a_time(
    docs: Iterable[str], tokenizer: Any, spec: DataSpec, *, source: str = "documents"
) -> Iterator[Batch]:
    """lensdiv 0.1's ``pack``, verbatim: the "before" of this benchmark."""
    bos_id = tokenizer.bos_token_id if spec.bos == "prepend" else None
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_id or 0)
    width = spec.seq_len - (bos_id is not None)
    rows: list[list[tuple[int, int]]] = []
    buffer: list[tuple[int, int]] = []
    budget = spec.max_tokens
    index = 0

    def emit(final: bool = False) -> Iterator[Batch]:
        nonlocal rows, index
        while rows and (len(rows) >= spec.batch_size or final):
            chunk, rows = rows[: spec.batch_size], rows[spec.batch_size :]
            length = max(len(r) for r in chunk)
            tokens = torch.full((len(chunk), length), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), length), dtype=torch.bool)
            doc = torch.full((len(chunk), length), -1, dtype=torch.long)
            for i, r in enumerate(chunk):
                tokens[i, : len(r)] = torch.tensor([t for t, _ in r])
                doc[i, : len(r)] = torch.tensor([d for _, d in r])
                mask[i, : len(r)] = True
            yield Batch(tokens=tokens, mask=mask, bos=bos_id is not None, index=index, doc=doc)
            index += 1

    def take(content: list[tuple[int, int]]) -> None:
        nonlocal budget
        row = ([(bos_id, content[0][1])] if bos_id is not None else []) + content
        row = row[:budget]
        budget -= len(row)
        if len(row) > (bos_id is not None):
            rows.append(row)

    n_docs = 0
    for doc in docs:
        if not doc.strip():
            continue
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        ids = ids + ([eos_id] if eos_id is not None else [])
        buffer.extend((t, n_docs) for t in ids)
        n_docs += 1
        while len(buffer) >= width and budget > 0:
            take(buffer[:width])
            buffer = buffer[width:]
        yield from emit()
        if budget <= 0:
            break
    if budget > 0 and buffer:
        take(buffer)
    if index == 0 and not rows:
        raise DataError(f"data {source!r} produced no tokens")
    yield from emit(final=True)


def gpt2_style_bpe() -> Any:
    """A byte-level BPE with GPT-2's pre-tokenizer (its regex) and byte alphabet, merges trained
    on 20000 documents of the built-in corpus (seed 1: not the benchmark's text), BOS = EOS =
    ``<|endoftext|>`` as in GPT-2; a ``PreTrainedTokenizerFast``, as hub models have."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=50257,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(itertools.islice(builtin_documents(seed=1), 20000), trainer)
    end = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=end, eos_token=end)


class KnownIds:
    """A tokenizer that looks the ids of each document up (packing alone, no tokenising)."""

    def __init__(self, tokenizer: Any, docs: list[str]) -> None:
        self.bos_token_id = tokenizer.bos_token_id
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
        self.ids = dict(zip(docs, ids, strict=True))

    def __call__(self, texts: list[str], **_: Any) -> dict[str, list[list[int]]]:
        return {"input_ids": [self.ids[text] for text in texts]}


def timed(fn: Callable[[], int]) -> Callable[[], tuple[int, float]]:
    """``fn`` (which returns tokens) made to return ``(tokens, CPU seconds of the process)``."""

    def run() -> tuple[int, float]:
        cpu = time.process_time()
        tokens = fn()
        return tokens, time.process_time() - cpu

    return run


def data_path(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: tokens/s of each case, for each tokenizer."""
    spec = DataSpec(max_tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size)
    tokenizers = {"bytes": byte_tokenizer(), "gpt2-style BPE": gpt2_style_bpe()}
    return {
        name: one_tokenizer(tokenizer, spec, args.repeats) for name, tokenizer in tokenizers.items()
    }


def one_tokenizer(tokenizer: Any, spec: DataSpec, repeats: int) -> dict[str, Any]:
    """The cases of part 1 with ``tokenizer``, on documents that fill ``spec``."""
    docs = corpus_for(tokenizer, spec)
    known = KnownIds(tokenizer, docs)

    def count(batches: Iterable[Batch]) -> int:
        return sum(b.n_tokens for b in batches)

    def tokenize_only() -> int:
        ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
        return sum(map(len, ids)) + len(ids)  # + EOS: the tokens packing makes of them

    cases = {
        "before": timed(lambda: count(pack_one_at_a_time(iter(docs), tokenizer, spec))),
        "after": timed(lambda: count(pack(iter(docs), tokenizer, spec))),
        "after, read ahead": timed(
            lambda: count(prefetch.read_ahead(pack(iter(docs), tokenizer, spec), prefetch.DEPTH))
        ),
        "after, cached": timed(with_cache(lambda: count(token_batches(spec, tokenizer)))),
        "tokenizer alone": timed(tokenize_only),
        "packing alone": timed(lambda: count(pack(iter(docs), known, spec))),
    }
    after = list(pack(iter(docs), tokenizer, spec))
    before = list(pack_one_at_a_time(iter(docs), tokenizer, spec))
    with_cache(lambda: list(token_batches(spec, tokenizer)))()  # warm the cache
    cached = with_cache(lambda: list(token_batches(spec, tokenizer)))()
    for a, b in zip(after, before, strict=True):  # the same batches, bit for bit
        assert a.index == b.index and torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.mask, b.mask) and torch.equal(a.doc, b.doc)  # type: ignore[arg-type]
    for a, c in zip(after, cached, strict=True):
        assert a.index == c.index and a.bos == c.bos and torch.equal(a.tokens, c.tokens)
        assert torch.equal(a.mask, c.mask) and torch.equal(a.doc, c.doc)  # type: ignore[arg-type]
    cpu: dict[str, float] = {k: float("inf") for k in cases}
    tokens: dict[str, int] = {}

    def record(case: str, got: tuple[int, float]) -> None:
        tokens[case] = got[0]
        cpu[case] = min(cpu[case], got[1])

    for fn in cases.values():  # warm-up
        fn()
    wall = best_of(cases, repeats, record)
    return {
        "documents": len(docs),
        "characters_per_token": round(sum(map(len, docs)) / tokens["after"], 2),
        "tokens": tokens,
        "seconds": {k: round(v, 3) for k, v in wall.items()},
        "cpu_seconds": {k: round(v, 3) for k, v in cpu.items()},
        "M_tokens_per_s": {k: round(tokens[k] / wall[k] / 1e6, 3) for k in cases},
        "M_tokens_per_cpu_s": {k: round(tokens[k] / cpu[k] / 1e6, 3) for k in cases},
        "after_over_before": round(wall["before"] / wall["after"], 2),
        "cached_over_after": round(wall["after"] / wall["after, cached"], 2),
    }


def with_cache(fn: Callable[[], _R]) -> Callable[[], _R]:
    """``fn`` run with the token cache on, in this benchmark's folder (it is off otherwise)."""

    def run() -> _R:
        os.environ[CACHE_ENV] = CACHE_DIR
        try:
            return fn()
        finally:
            os.environ[CACHE_ENV] = "off"

    return run


def corpus_for(tokenizer: Any, spec: DataSpec) -> list[str]:
    """The first documents of the built-in corpus that fill ``spec.max_tokens`` and a row."""
    docs, tokens = [], 0
    for doc in builtin_documents(seed=0):
        docs.append(doc)
        tokens += len(tokenizer(doc, add_special_tokens=False)["input_ids"]) + 1
        if tokens > spec.max_tokens + spec.seq_len:
            return docs
    raise AssertionError("the built-in corpus is endless")


def slowed(tokenizer: Any, seconds_per_char: float) -> Any:
    """A copy of ``tokenizer`` that first sleeps ``seconds_per_char`` per character it is given
    (off the interpreter's lock, like a tokenizer working in native code)."""

    class Slow(type(tokenizer)):  # type: ignore[misc]  # a subclass of whatever class it is
        def __call__(self, text: Any, *rest: Any, **kwargs: Any) -> Any:
            chars = len(text) if isinstance(text, str) else sum(map(len, text))
            time.sleep(chars * seconds_per_char)
            return super().__call__(text, *rest, **kwargs)

    slow = copy.deepcopy(tokenizer)
    slow.__class__ = Slow
    return slow


def overlap(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: a run whose tokenizer is as slow as its model, serial and overlapped (the token
    cache off: every case that reads data tokenises it)."""
    assert os.environ[CACHE_ENV] == "off"
    torch.set_grad_enabled(False)
    model = place(build(args.layers, args.d_model, args.vocab), args)
    fast = model.tokenizer
    rows = args.overlap_tokens // args.seq_len
    spec = DataSpec(
        max_tokens=rows * args.seq_len, seq_len=args.seq_len, batch_size=args.batch_size
    )
    batches = list(token_batches(spec, fast))
    assert all(b.mask.all() for b in batches)  # full rows: the same batches as a token tensor
    tensor = torch.cat([b.tokens for b in batches])

    def run(data: Any) -> None:
        result = analyze(
            model,
            data=data,
            plugins="lens",
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            max_tokens=spec.max_tokens,
            progress=False,
        )
        assert result.ok, result.errors

    def compute() -> None:
        run(tensor)

    compute()  # warm-up
    t0 = time.perf_counter()
    compute()
    compute_s = time.perf_counter() - t0
    # The data alone about as long as the model alone: the hardest case for an overlap.
    delay = compute_s / characters_read(spec, fast)
    model.tokenizer = slowed(fast, delay)
    slow = model.tokenizer

    def data() -> None:
        assert sum(b.n_tokens for b in token_batches(spec, slow)) == spec.max_tokens

    def serial() -> None:
        prefetch.DEPTH = 0
        try:
            run(None)
        finally:
            prefetch.DEPTH = depth

    depth = prefetch.DEPTH
    cases = {
        "compute": compute,
        "data": data,
        "run, serial": serial,
        "run, overlapped": lambda: run(None),
    }
    best = best_of(cases, args.repeats)
    model.tokenizer = fast
    larger, both = max(best["compute"], best["data"]), best["compute"] + best["data"]
    return {
        "model": f"{args.layers} layers, d_model {args.d_model}, vocab {args.vocab} (random)",
        "device": device_name(args.device),
        "dtype": args.dtype,
        "analyzer": "lens",
        "tokens": spec.max_tokens,
        "seconds_per_character": delay,
        "seconds": {k: round(v, 3) for k, v in best.items()},
        "serial_over_sum": round(best["run, serial"] / both, 3),
        "overlapped_over_max": round(best["run, overlapped"] / larger, 3),
        "overlapped_over_sum": round(best["run, overlapped"] / both, 3),
        "serial_over_overlapped": round(best["run, serial"] / best["run, overlapped"], 3),
    }


def characters_read(spec: DataSpec, tokenizer: Any) -> int:
    """Characters the data path hands the tokenizer for ``spec`` (chunks read ahead included)."""
    seen = [0]

    class Counting:
        bos_token_id, eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        pad_token_id = tokenizer.pad_token_id

        def __call__(self, texts: list[str], **kwargs: Any) -> Any:
            seen[0] += sum(map(len, texts))
            return tokenizer(texts, **kwargs)

    for _ in token_batches(spec, Counting()):
        pass
    return seen[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000, help="part 1")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--overlap-tokens", type=int, default=65536, help="part 2")
    parser.add_argument("--layers", type=int, default=4, help="part 2's model")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", help="also write the figures to this file")
    add_device(parser)  # part 2's model (part 1, the data path, runs on the CPU)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ[CACHE_ENV] = "off"  # on only in the cached case (with_cache)
    figures: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "data_path": data_path(args),
    }
    entries = len(os.listdir(CACHE_DIR))
    figures["overlap"] = overlap(args)
    assert len(os.listdir(CACHE_DIR)) == entries  # part 2 tokenised: it wrote no cache entry
    figures["token_cache_entries"] = {"after part 1": entries, "after part 2": entries}
    figures["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    report(figures, args.json)


if __name__ == "__main__":
    main()
