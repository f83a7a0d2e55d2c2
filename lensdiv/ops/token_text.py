"""One token as text a reader can tell apart: its decoded text, or its bytes where it has none.

A token that is part of a character (a byte of UTF-8: the toy models' byte tokenizer, GPT-2's
byte-level BPE, a SentencePiece byte fallback) decodes alone to ``"\\ufffd"`` ("�"), the same for
every such byte. :func:`token_text` writes those bytes as ``<0xC3>`` instead (the way
SentencePiece names its byte pieces), keeping the rest of the token's text:
GPT-2's ``" \\xe2\\x80"`` is ``" <0xE2><0x80>"``.
"""

from __future__ import annotations

import codecs
import re
from functools import cache

from lensdiv.core.bridge import Tokenizer

REPLACEMENT = "\ufffd"
_HEX = "lensdiv-hex"
_PIECE = re.compile(r"(?:<0x[0-9A-Fa-f]{2}>)+")


def _hex(err: UnicodeError) -> tuple[str, int]:
    assert isinstance(err, UnicodeDecodeError)
    return "".join(f"<0x{b:02X}>" for b in err.object[err.start : err.end]), err.end


codecs.register_error(_HEX, _hex)


@cache
def _byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet (``tokenizers``' ByteLevel): each shown character → its byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """The text of ``token``; where that has a "�", its bytes written ``<0xNN>`` (see the
    module's description). A tokenizer that cannot name the token's piece keeps the "�"."""
    text = str(tokenizer.decode([token]))
    if REPLACEMENT not in text:
        return text
    try:
        piece = tokenizer.convert_ids_to_tokens(token)
    except Exception:  # any tokenizer without pieces: the decoded text is all there is
        return text
    if not isinstance(piece, str):
        return text
    if _PIECE.fullmatch(piece):  # SentencePiece's byte fallback names its bytes so
        return piece.upper().replace("<0X", "<0x")
    byte_of = _byte_of()
    if piece and all(c in byte_of for c in piece):  # byte-level BPE
        return bytes(byte_of[c] for c in piece).decode("utf-8", errors=_HEX)
    return text
