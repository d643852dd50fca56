"""BERT's uncased WordPiece tokenisation, from a ``vocab.txt``.

The steps of ``transformers``' ``BertTokenizer`` (``BasicTokenizer`` then
``WordpieceTokenizer``) with ``do_lower_case=True``: drop control characters and turn every
whitespace into a space; put spaces around CJK ideographs; lower-case and strip accents
(NFD, then drop the combining marks); split on whitespace and on every punctuation character
(ASCII non-alphanumerics and the Unicode ``P*`` categories); then each word, greedily, into the
longest vocabulary entry from its start, the rest continued with ``##`` entries. A word with a
piece outside the vocabulary, or longer than 100 characters, becomes ``[UNK]``.
"""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Mapping

from mhanum._errors import InvalidArgument

MAX_WORD_CHARS = 100


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def _clean(text: str) -> str:
    out = []
    for ch in text:
        cp = ord(ch)
        if cp in (0, 0xFFFD):
            continue
        if ch in " \t\n\r" or unicodedata.category(ch) == "Zs":
            out.append(" ")
        elif unicodedata.category(ch).startswith("C"):
            continue
        elif _is_cjk(cp):
            out.append(f" {ch} ")
        else:
            out.append(ch)
    return "".join(out)


def basic_tokens(text: str) -> list[str]:
    """The words of BERT's uncased ``BasicTokenizer``: cleaned, lower-cased, accents stripped,
    split on whitespace and punctuation.

    Examples:
        >>> basic_tokens("Héllo, World!")
        ['hello', ',', 'world', '!']
    """
    words = []
    for word in _clean(text).split():
        plain = "".join(
            ch
            for ch in unicodedata.normalize("NFD", word.lower())
            if unicodedata.category(ch) != "Mn"
        )
        current: list[str] = []
        for ch in plain:
            if _is_punctuation(ch):
                if current:
                    words.append("".join(current))
                    current = []
                words.append(ch)
            else:
                current.append(ch)
        if current:
            words.append("".join(current))
    return words


@dataclasses.dataclass(frozen=True)
class WordPiece:
    """BERT's uncased tokenizer over a vocabulary (token to id).

    Examples:
        >>> vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "un", "##aff", "##able", "a"]
        >>> tok = WordPiece({t: i for i, t in enumerate(vocab)})
        >>> tok.tokenize("Unaffable a b")
        ['un', '##aff', '##able', 'a', '[UNK]']
        >>> tok.encode("unaffable")
        [2, 4, 5, 6, 3]
    """

    vocab: Mapping[str, int] = dataclasses.field(repr=False)
    unk: str = "[UNK]"
    cls: str = "[CLS]"
    sep: str = "[SEP]"

    def __post_init__(self) -> None:
        for name in ("unk", "cls", "sep"):
            token = getattr(self, name)
            if token not in self.vocab:
                msg = f"vocab: expected the special token {token!r}, found none"
                raise InvalidArgument(msg)

    def word_pieces(self, word: str) -> list[str]:
        """One word's greedy longest-match-first pieces, or ``[unk]``."""
        if len(word) > MAX_WORD_CHARS:
            return [self.unk]
        pieces = []
        start = 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    break
                end -= 1
            if end == start:
                return [self.unk]
            pieces.append(piece)
            start = end
        return pieces

    def tokenize(self, text: str) -> list[str]:
        """The WordPiece tokens of ``text``, without ``[CLS]``/``[SEP]``."""
        if not isinstance(text, str):
            msg = f"sentences: expected strings, got {type(text).__name__}"
            raise InvalidArgument(msg)
        return [piece for word in basic_tokens(text) for piece in self.word_pieces(word)]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``[CLS] tokens [SEP]``."""
        tokens = [self.cls, *self.tokenize(text), self.sep]
        return [self.vocab[t] for t in tokens]
