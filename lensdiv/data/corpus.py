"""Synthetic corpora, generated deterministically from a seed (nothing is stored).

Two kinds of documents, mixed for training the toy models:

- **Language-like text** from a small probabilistic grammar. Subject–verb agreement crosses
  relative clauses (dependencies several words long), and every document has a hidden topic that
  biases its nouns (structure at document length), so next-token prediction is non-trivial.
- **Multi-hop queries over a knowledge base.** A seeded random knowledge base maps each
  (relation, entity) to an entity. Facts are written ``boss(ka)=mi;``; a k-hop query composes k
  relations, ``friend(boss(ka))=lu;``. Facts are memorised from training documents; a query chain
  (its start entity and relation sequence) belongs to the held-out split or to the training split,
  never both, so held-out queries of 2–4 hops are compositions the model has never seen. 1-hop
  queries are the facts themselves (the knowledge being composed), graded as hop 1.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

CORPUS_VERSION = 2

_NOUNS = [
    ("cat", "cats"),
    ("dog", "dogs"),
    ("teacher", "teachers"),
    ("child", "children"),
    ("bird", "birds"),
    ("farmer", "farmers"),
    ("robot", "robots"),
    ("king", "kings"),
    ("student", "students"),
    ("river", "rivers"),
    ("doctor", "doctors"),
    ("city", "cities"),
    ("ship", "ships"),
    ("queen", "queens"),
    ("tree", "trees"),
    ("engine", "engines"),
]
_VERBS = [
    ("sees", "see"),
    ("likes", "like"),
    ("follows", "follow"),
    ("helps", "help"),
    ("finds", "find"),
    ("watches", "watch"),
    ("knows", "know"),
    ("calls", "call"),
]
_INTRANSITIVE = [
    ("sleeps", "sleep"),
    ("sings", "sing"),
    ("waits", "wait"),
    ("runs", "run"),
    ("laughs", "laugh"),
    ("works", "work"),
]
_ADJECTIVES = ["old", "small", "green", "quiet", "clever", "tall", "happy", "distant"]
_ADVERBS = ["today", "again", "at night", "in the morning", "slowly", "often"]
_TOPICS = 4  # each topic prefers a quarter of the nouns

RELATIONS = ("boss", "friend", "rival", "mentor")
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
MAX_HOPS = 4
QUERY_HOPS = tuple(range(1, MAX_HOPS + 1))  # the queries of a knowledge-base document
CHAINS = ("unseen", "seen")  # multi-hop queries asked: held-out chains, or training-split ones


# -- language-like text -------------------------------------------------------------------------
def _noun_phrase(rng: random.Random, topic: int, depth: int = 0) -> tuple[str, bool]:
    plural = rng.random() < 0.4
    if rng.random() < 0.75:  # topical noun: the document's hidden state shows here
        index = topic * (len(_NOUNS) // _TOPICS) + rng.randrange(len(_NOUNS) // _TOPICS)
    else:
        index = rng.randrange(len(_NOUNS))
    words = ["the"] + ([rng.choice(_ADJECTIVES)] if rng.random() < 0.4 else [])
    words.append(_NOUNS[index][plural])
    if depth < 2 and rng.random() < 0.3:
        obj, _ = _noun_phrase(rng, topic, depth + 1)
        words += ["that", rng.choice(_VERBS)[plural], obj]
    return " ".join(words), plural


def sentence(rng: random.Random, topic: int = 0) -> str:
    """One sentence whose main verb agrees with its (possibly distant) subject."""
    subject, plural = _noun_phrase(rng, topic)
    if rng.random() < 0.5:
        obj, _ = _noun_phrase(rng, topic, 1)
        predicate = f"{rng.choice(_VERBS)[plural]} {obj}"
    else:
        predicate = rng.choice(_INTRANSITIVE)[plural]
    if rng.random() < 0.3:
        predicate += " " + rng.choice(_ADVERBS)
    text = f"{subject} {predicate}"
    return text[0].upper() + text[1:] + "."


def language_documents(seed: int = 0, n_documents: int | None = None) -> Iterator[str]:
    """Documents of 3–8 sentences about one hidden topic (endless unless ``n_documents``)."""
    rng = random.Random(f"language-{seed}")
    for _ in range(n_documents) if n_documents is not None else itertools.count():
        topic = rng.randrange(_TOPICS)
        yield " ".join(sentence(rng, topic) for _ in range(rng.randint(3, 8)))


# -- knowledge base and multi-hop queries -------------------------------------------------------
@dataclass(frozen=True)
class Query:
    """One multi-hop query.

    Args:
        relations: Applied innermost first: ``("boss", "friend")`` is ``friend(boss(x))``.
        start: The entity the chain starts from.
        answer: The entity it ends at.
    """

    relations: tuple[str, ...]
    start: str
    answer: str

    @property
    def hops(self) -> int:
        """Number of relations composed."""
        return len(self.relations)

    @property
    def prompt(self) -> str:
        """``friend(boss(ka))=``: the text before the answer."""
        text = self.start
        for relation in self.relations:
            text = f"{relation}({text})"
        return text + "="

    @property
    def text(self) -> str:
        """The query with its answer, as it appears in a document."""
        return f"{self.prompt}{self.answer};"


@dataclass(frozen=True)
class KnowledgeBase:
    """A random function per relation over a set of two-letter entities.

    Args:
        seed: Everything (entities, facts, split) follows from it.
        n_entities: Number of entities.
        held_out: Fraction of multi-hop chains reserved for the held-out split.
    """

    seed: int = 0
    n_entities: int = 24
    held_out: float = 0.3

    @cached_property
    def entities(self) -> tuple[str, ...]:
        """Entity names (consonant + vowel)."""
        rng = random.Random(f"kb-entities-{self.seed}")
        names = [c + v for c in _CONSONANTS for v in _VOWELS]
        return tuple(rng.sample(names, self.n_entities))

    @cached_property
    def facts(self) -> dict[tuple[str, str], str]:
        """``{(relation, entity): entity}``."""
        rng = random.Random(f"kb-facts-{self.seed}")
        return {(r, e): rng.choice(self.entities) for r in RELATIONS for e in self.entities}

    def answer(self, relations: tuple[str, ...], start: str) -> str:
        """Follow ``relations`` from ``start``."""
        entity = start
        for relation in relations:
            entity = self.facts[(relation, entity)]
        return entity

    def split_of(self, relations: tuple[str, ...], start: str) -> str:
        """``"train"`` or ``"test"`` for a chain; 1-hop chains (the facts) are always train."""
        if len(relations) == 1:
            return "train"
        key = f"{self.seed}|{start}|{'.'.join(relations)}".encode()
        bucket = int.from_bytes(hashlib.sha256(key).digest()[:4], "big") / 2**32
        return "test" if bucket < self.held_out else "train"

    def queries(
        self, split: str, hops: int, *, seed: int = 0, n: int | None = None
    ) -> Iterator[Query]:
        """Random ``hops``-hop queries of one split (1-hop queries are the facts)."""
        rng = random.Random(f"kb-queries-{self.seed}-{split}-{hops}-{seed}")
        count = 0
        tries = 0
        while n is None or count < n:
            relations = tuple(rng.choice(RELATIONS) for _ in range(hops))
            start = rng.choice(self.entities)
            tries += 1
            if hops > 1 and self.split_of(relations, start) != split:
                if tries > 10_000 and count == 0:
                    raise ValueError(f"no {hops}-hop chains in split {split!r}")
                continue
            count += 1
            yield Query(relations, start, self.answer(relations, start))

    def chain(self, query: Query) -> list[tuple[str, str]]:
        """The ``(relation, entity)`` facts a query's chain passes through."""
        steps, entity = [], query.start
        for relation in query.relations:
            steps.append((relation, entity))
            entity = self.facts[(relation, entity)]
        return steps

    def asked(
        self, n: int, *, seed: int = 1, context: int = 3, chains: str = "unseen"
    ) -> dict[int, list[tuple[str, str]]]:
        """``n`` queries per hop count, each as asked in the training documents:
        ``Query.prompt`` is preceded by ``context`` other facts (never ones on the query's own
        chain). 1-hop queries are the facts; longer ones are held-out chains (``chains=
        "unseen"``: compositions no training document holds) or chains of the training split
        (``"seen"``). Returns ``{hops: [(prompt, answer), ...]}``.
        """
        asked = self.asked_queries(n, seed=seed, context=context, chains=chains)
        return {hops: [(prompt, q.answer) for q, prompt in rows] for hops, rows in asked.items()}

    def asked_queries(
        self, n: int, *, seed: int = 1, context: int = 3, chains: str = "unseen"
    ) -> dict[int, list[tuple[Query, str]]]:
        """:meth:`asked` with each query itself: ``{hops: [(query, full prompt), ...]}``."""
        if chains not in CHAINS:
            raise ValueError(f"chains must be one of {', '.join(CHAINS)}, got {chains!r}")
        facts = list(self.facts.items())
        rng = random.Random(f"multihop-eval-{seed}")
        out: dict[int, list[tuple[Query, str]]] = {}
        for hops in range(1, MAX_HOPS + 1):
            split = "train" if hops == 1 or chains == "seen" else "test"
            out[hops] = []
            for q in self.queries(split, hops, seed=seed, n=n):
                chain = set(self.chain(q))
                before = [
                    f"{r}({e})={a};" for (r, e), a in rng.sample(facts, 8) if (r, e) not in chain
                ]
                out[hops].append((q, " ".join([*before[:context], q.prompt])))
        return out

    def prior_accuracy(self, relations: tuple[str, ...]) -> float:
        """Accuracy of the best answer to a chain of ``relations`` that ignores its start entity.

        The relations are not onto, so some entities end many chains: always answering the most
        common end of the chain (over all start entities) beats ``1 / n_entities``. A model that
        has learnt only which entities each relation tends to return scores this much.
        """
        ends = Counter(self.answer(relations, e) for e in self.entities)
        return max(ends.values()) / self.n_entities

    def documents(
        self, split: str = "train", seed: int = 0, hops: tuple[int, ...] = QUERY_HOPS
    ) -> Iterator[str]:
        """Documents of facts and queries: 4 facts, then one query per entry of ``hops`` (by
        default one of each hop count), shuffled."""
        rng = random.Random(f"kb-docs-{self.seed}-{split}-{seed}")
        streams = {h: self.queries(split, h, seed=seed) for h in sorted(set(hops))}
        facts = list(self.facts.items())
        while True:
            parts = [f"{r}({e})={a};" for (r, e), a in rng.sample(facts, 4)]
            parts += [next(streams[h]).text for h in hops]
            rng.shuffle(parts)
            yield " ".join(parts)


def mixed_documents(
    seed: int = 0,
    split: str = "train",
    kb_fraction: float = 0.35,
    kb: KnowledgeBase | None = None,
    kb_hops: tuple[int, ...] = QUERY_HOPS,
) -> Iterator[str]:
    """The toy models' training mix: language documents and knowledge-base documents (whose
    queries have the hop counts ``kb_hops``, see :meth:`KnowledgeBase.documents`)."""
    kb = kb or KnowledgeBase(seed=0)
    rng = random.Random(f"mix-{seed}-{split}")
    offset = 0 if split == "train" else 1_000_003  # a different stream of language documents
    language = language_documents(seed + offset)
    facts = kb.documents(split, seed=seed, hops=kb_hops)
    while True:
        yield next(facts) if rng.random() < kb_fraction else next(language)


def builtin_documents(seed: int = 0, n_documents: int | None = None) -> Iterator[str]:
    """The built-in corpus for ``lensdiv analyze``: the held-out mix the toy models never saw."""
    docs = mixed_documents(seed=seed, split="test")
    yield from docs if n_documents is None else itertools.islice(docs, n_documents)
