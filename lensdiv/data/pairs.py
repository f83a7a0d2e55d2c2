"""Clean/corrupt prompt pairs for causal interventions: the built-in set, JSONL files, batches.

A pair is ``{clean, corrupt, target[, foil]}``: two prompts of the same token length whose
answers differ (``target`` after the clean prompt, ``foil`` after the corrupt one).

- **Built-in pairs** (:func:`builtin_pairs`): facts of the toy corpus' knowledge base
  (``boss(ka)=`` against ``boss(mi)=``) for the byte tokenizer of the toy models, capital cities
  (``The capital of France is`` → ``" Paris"``) for other tokenizers.
- **Files** (:func:`read_pairs`): JSONL, one object per line; the line number names the pair.
- **Answer position** = the last token of the prompt (the answer is predicted there).
- **Answer token** (:func:`answer_token`) = the first token of the target tokenised *as a
  continuation*: the token that follows the prompt's tokens in ``tokenize(clean + target)``;
  when the prompt's tokens are not a prefix of that (a merge across the boundary), the first
  token of ``tokenize(target)`` alone. So write the space yourself where the tokenizer marks word
  starts (``" Paris"``). A target or foil may also be an integer token id. The foil is tokenised
  after the corrupt prompt.
- **Batches** (:func:`pair_batches`): BOS prepended (optionally), pairs grouped by token length;
  the clean prompts are the batch's tokens, the rest is in :attr:`Batch.extra`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lensdiv.core.analyzer import Batch
from lensdiv.core.bridge import Tokenizer
from lensdiv.core.errors import DataError
from lensdiv.data.corpus import RELATIONS, KnowledgeBase, Query
from lensdiv.data.tasks import read_task_jsonl
from lensdiv.data.tokenizer import SPECIALS, VOCAB_SIZE

ANSWER_RULE = (
    "first token of the target tokenised as a continuation of the prompt "
    "(tokenize(prompt + target) after tokenize(prompt); tokenize(target) alone when the prompt's "
    "tokens are not a prefix); integer targets are token ids"
)


@dataclass(frozen=True)
class Pair:
    """One clean/corrupt pair as read from the task file.

    Args:
        line: 1-based line number in the file (or index in the built-in set).
        clean: The prompt whose answer is ``target``.
        corrupt: A prompt of the same token length whose answer differs.
        target: The clean answer (string, or a token id).
        foil: The corrupt answer (needed by ``metric=logit_diff``).
    """

    line: int
    clean: str
    corrupt: str
    target: str | int
    foil: str | int | None = None


def read_pairs(path: str | Path) -> list[Pair]:
    """Read a JSONL file of ``{clean, corrupt, target[, foil]}`` objects, one per line.

    Raises:
        DataError: Missing or empty file, bad JSON, a missing key or a wrong type, naming the line.
    """

    path = Path(path)
    pairs = []
    required = ("clean", "corrupt", "target")
    for number, row in read_task_jsonl(
        path, required, what="pairs", option="patch.pairs", numbers=("target",)
    ):
        where = f"{path.name} line {number}"
        for key in ("clean", "corrupt"):
            if not isinstance(row[key], str) or not row[key]:
                raise DataError(f"{where}: {key!r} must be a non-empty string")
        for key in ("target", "foil"):
            value = row.get(key)
            if key == "foil" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise DataError(f"{where}: {key!r} must be a string or a token id")
        pairs.append(Pair(number, row["clean"], row["corrupt"], row["target"], row.get("foil")))
    return pairs


_CAPITALS = (
    ("France", "Paris"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
    ("Chile", "Santiago"),
    ("China", "Beijing"),
    ("Russia", "Moscow"),
    ("Greece", "Athens"),
    ("Cuba", "Havana"),
    ("Norway", "Oslo"),
    ("Poland", "Warsaw"),
    ("Austria", "Vienna"),
    ("Germany", "Berlin"),
)
_BUILTIN_PAIRS = 16


def is_byte_tokenizer(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` is the toy models' byte tokenizer."""
    try:
        specials = tokenizer.convert_ids_to_tokens(list(range(len(SPECIALS))))
        return len(tokenizer) == VOCAB_SIZE and tuple(specials) == SPECIALS
    except Exception:  # any tokenizer without these methods is not ours
        return False


def builtin_pairs(tokenizer: Tokenizer) -> list[Pair]:
    """The built-in task: knowledge-base facts for the byte tokenizer, capitals otherwise.

    Byte tokenizer (toy models): 4 facts per relation of the toy corpus' knowledge base,
    ``boss(ka)=`` → its answer, corrupted by another entity whose answer starts with a different
    letter (the foil). Other tokenizers: ``The capital of France is`` → ``" Paris"`` against other
    countries, keeping pairs whose prompts tokenise to the same length and whose answers differ
    in their first token.
    """
    if is_byte_tokenizer(tokenizer):
        kb = KnowledgeBase(seed=0)  # the knowledge base every toy model is trained on
        pairs: list[Pair] = []
        per_relation = _BUILTIN_PAIRS // len(RELATIONS)
        for relation in RELATIONS:
            entities = kb.entities
            used = 0
            for i, entity in enumerate(entities):
                answer = kb.answer((relation,), entity)
                for other in entities[i + 1 :] + entities[:i]:
                    foil = kb.answer((relation,), other)
                    if foil[0] != answer[0]:
                        pairs.append(
                            Pair(
                                len(pairs) + 1,
                                Query((relation,), entity, answer).prompt,
                                Query((relation,), other, foil).prompt,
                                answer,
                                foil,
                            )
                        )
                        used += 1
                        break
                if used == per_relation:
                    break
        return pairs
    unk = getattr(tokenizer, "unk_token_id", None)
    pairs = []
    for country, capital in _CAPITALS:
        for other, foil in _CAPITALS:
            if other == country:
                continue
            clean, corrupt = f"The capital of {country} is", f"The capital of {other} is"
            ids = [_encode(tokenizer, clean), _encode(tokenizer, corrupt)]
            if len(ids[0]) != len(ids[1]):
                continue
            answers = [_answer_id(tokenizer, clean, " " + capital)]
            answers.append(_answer_id(tokenizer, corrupt, " " + foil))
            if answers[0] == answers[1] or unk in [*ids[0], *ids[1], *answers] or None in answers:
                continue
            pairs.append(Pair(len(pairs) + 1, clean, corrupt, " " + capital, " " + foil))
            break  # one corruption per country keeps the set varied
        if len(pairs) == _BUILTIN_PAIRS:
            break
    return pairs


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _answer_id(tokenizer: Tokenizer, prompt: str, target: str) -> int | None:
    """The answer-token rule (module docstring); ``None`` when the target tokenises to nothing."""
    head = _encode(tokenizer, prompt)
    full = _encode(tokenizer, prompt + target)
    if len(full) > len(head) and full[: len(head)] == head:
        return full[len(head)]
    alone = _encode(tokenizer, target)
    return alone[0] if alone else None


def answer_token(
    tokenizer: Tokenizer, prompt: str, target: str | int, d_vocab: int, where: str
) -> int:
    """Token id of ``target`` after ``prompt`` (see the module docstring), checked.

    Raises:
        DataError: The target tokenises to nothing or to the unknown token, or an id is outside
            the model's vocabulary.
    """
    hint = "give a target the tokenizer knows (or its token id below d_vocab)"
    if isinstance(target, int):
        if not 0 <= target < d_vocab:
            raise DataError(
                f"{where}: token id {target} is not in the vocabulary (d_vocab={d_vocab})",
                hint=hint,
            )
        return target
    token = _answer_id(tokenizer, prompt, target)
    if token is None:
        raise DataError(f"{where}: {target!r} tokenises to nothing", hint=hint)
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and token == unk:
        raise DataError(
            f"{where}: {target!r} is not in the vocabulary (it tokenises to the unknown token)",
            hint=hint,
        )
    if token >= d_vocab:
        raise DataError(
            f"{where}: {target!r} tokenises to id {token}, outside the model's vocabulary "
            f"(d_vocab={d_vocab})",
            hint="the tokenizer does not match the model",
        )
    return token


def pair_batches(
    tokenizer: Tokenizer,
    pairs: Sequence[Pair],
    *,
    source: str,
    d_vocab: int,
    n_ctx: int = 0,
    prepend_bos: bool = True,
    logit_diff: bool = True,
    batch_size: int = 8,
) -> list[Batch]:
    """Tokenise and check ``pairs``, then batch them by token length.

    Every batch holds pairs of one length (shortest first, in file order within a length): the
    clean prompts are its ``tokens``; ``extra`` has ``corrupt`` (token ids), ``target`` and
    ``foil`` (answer token ids) and ``line`` (each pair's :attr:`Pair.line`, unique in the set).

    Args:
        tokenizer: The model's tokenizer.
        pairs: The pairs.
        source: How error messages name a pair, before its line (``"pairs.jsonl line"``).
        d_vocab: The model's vocabulary size (answer ids must be below it).
        n_ctx: The model's context (``0``: unknown, not checked).
        prepend_bos: Put the tokenizer's BOS token before every prompt.
        logit_diff: The metric compares target and foil: every pair needs a foil whose first
            token differs from the target's. Otherwise a missing foil is the target itself.
        batch_size: Pairs per batch.

    Raises:
        DataError: Clean and corrupt of different lengths, a prompt longer than the context, a
            bad answer (:func:`answer_token`), or a missing or useless foil — naming the pair.
    """
    bos = tokenizer.bos_token_id if prepend_bos else None
    rows: dict[int, list[tuple[list[int], list[int], int, int, int]]] = {}
    for pair in pairs:
        where = f"{source} {pair.line}"
        clean = ([bos] if bos is not None else []) + _encode(tokenizer, pair.clean)
        corrupt = ([bos] if bos is not None else []) + _encode(tokenizer, pair.corrupt)
        if len(clean) != len(corrupt):
            raise DataError(
                f"{where}: clean and corrupt tokenise to different lengths "
                f"({len(clean)} vs {len(corrupt)} tokens)",
                hint="patching compares positions one to one; make the prompts differ by "
                "words of equal token length",
            )
        target = answer_token(tokenizer, pair.clean, pair.target, d_vocab, where)
        if pair.foil is None:
            if logit_diff:
                raise DataError(
                    f"{where}: no 'foil', but metric logit_diff needs one",
                    hint="add the corrupt prompt's answer as foil, or use -O patch.metric=prob",
                )
            foil = target
        else:
            foil = answer_token(tokenizer, pair.corrupt, pair.foil, d_vocab, where)
            if foil == target and logit_diff:
                raise DataError(
                    f"{where}: target {pair.target!r} and foil {pair.foil!r} start with the "
                    f"same token (id {target}), so their logit difference is always 0",
                    hint="choose answers whose first tokens differ",
                )
        if n_ctx and len(clean) > n_ctx:
            raise DataError(
                f"{where}: the prompt has {len(clean)} tokens, more than the model's context "
                f"of {n_ctx}",
                hint="shorten the prompts",
            )
        rows.setdefault(len(clean), []).append((clean, corrupt, target, foil, pair.line))
    batches: list[Batch] = []
    for length in sorted(rows):
        group = rows[length]
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            tokens = torch.tensor([c[0] for c in chunk], dtype=torch.long)
            batches.append(
                Batch(
                    tokens=tokens,
                    mask=torch.ones_like(tokens, dtype=torch.bool),
                    bos=bos is not None,
                    index=len(batches),
                    extra={
                        "corrupt": torch.tensor([c[1] for c in chunk], dtype=torch.long),
                        "target": torch.tensor([c[2] for c in chunk], dtype=torch.long),
                        "foil": torch.tensor([c[3] for c in chunk], dtype=torch.long),
                        "line": [c[4] for c in chunk],
                    },
                )
            )
    return batches
