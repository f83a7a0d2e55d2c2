"""The built-in corpus: English-like text from a small probabilistic grammar, generated from a seed.

Subject–verb agreement crosses relative clauses, so predicting the verb needs context several words
back. Nothing is stored: the same seed always gives the same text.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

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


def _noun_phrase(rng: random.Random, depth: int = 0) -> tuple[str, int]:
    plural = rng.random() < 0.4
    noun = _NOUNS[rng.randrange(len(_NOUNS))][plural]
    words = ["the"] + ([rng.choice(_ADJECTIVES)] if rng.random() < 0.4 else []) + [noun]
    if depth < 2 and rng.random() < 0.3:
        obj, _ = _noun_phrase(rng, depth + 1)
        verb = rng.choice(_VERBS)[plural]
        words += ["that", verb, obj]
    return " ".join(words), plural


def sentence(rng: random.Random) -> str:
    """One sentence whose main verb agrees with its (possibly distant) subject."""
    subject, plural = _noun_phrase(rng)
    if rng.random() < 0.5:
        obj, _ = _noun_phrase(rng, 1)
        predicate = f"{rng.choice(_VERBS)[plural]} {obj}"
    else:
        predicate = rng.choice(_INTRANSITIVE)[plural]
    if rng.random() < 0.3:
        predicate += " " + rng.choice(_ADVERBS)
    text = f"{subject} {predicate}"
    return text[0].upper() + text[1:] + "."


def builtin_documents(seed: int = 0, n_documents: int | None = None) -> Iterator[str]:
    """Yield documents of 3–8 sentences (endless unless ``n_documents`` is given)."""
    rng = random.Random(seed)
    count = 0
    while n_documents is None or count < n_documents:
        yield " ".join(sentence(rng) for _ in range(rng.randint(3, 8)))
        count += 1
