"""The tokenizer, loaded with the `tokenizers` library, and its digest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .config import ModelError


def tokenizer_digest(tokenizer_json: str, config_json: str | None) -> str:
    """SHA-256 of the tokenizer's files, as the namespace of the cache keys records it."""
    digest = hashlib.sha256(b"kvctl/tokenizer/v1\0" + tokenizer_json.encode("utf-8"))
    if config_json is not None:
        digest.update(config_json.encode("utf-8"))
    return digest.hexdigest()


class Tokenizer:
    """A model's tokenizer: `tokenizer.json` (and `tokenizer_config.json`, for the special
    tokens) read with the `tokenizers` library. Its `digest` names those two files' bytes: two
    tokenizers with one digest encode alike (it is part of every cache key's namespace).

    The special tokens a prompt gets (`encode(text)`, as /v1/completions encodes a prompt) are
    those `tokenizer.json`'s post-processor adds, as `transformers` (from 5.0, which sets
    `tokenizer_config.json`'s `add_bos_token` aside where there is a `tokenizer.json`) and so vLLM
    add them: Llama 3's `<|begin_of_text|>`; Qwen's, nothing; none where there is no
    post-processor. A chat's prompt is encoded without them: its template writes its own."""

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"model: no tokenizer.json in {str(model_dir)!r}")
        config_path = model_dir / "tokenizer_config.json"
        # bytes decoded as they are (no newline translation): the digest is of the files' bytes
        self._load(path.read_bytes().decode("utf-8"),
                   config_path.read_bytes().decode("utf-8") if config_path.is_file() else None)

    @classmethod
    def from_texts(cls, tokenizer_json: str, config_json: str | None) -> "Tokenizer":
        """The tokenizer whose files hold these texts (what kvd's `GET /admin/tokenizer` gives)."""
        tokenizer = cls.__new__(cls)
        tokenizer._load(tokenizer_json, config_json)
        return tokenizer

    def _load(self, tokenizer_json: str, config_json: str | None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_str(tokenizer_json)
        self._token_texts: dict[int, str] = {}
        self.texts = (tokenizer_json, config_json)  # as read: the digest is of these
        self.config = json.loads(config_json) if config_json is not None else {}
        self.digest = tokenizer_digest(tokenizer_json, config_json)
        self.eos_token_id = self._special(self.config.get("eos_token"))
        self.bos_token_id = self._special(self.config.get("bos_token"))
        self._kept: frozenset[int] = frozenset()  # special tokens decoded text keeps (keep_in_text)
        self._specials = frozenset(i for i, added in self._tok.get_added_tokens_decoder().items() if added.special)
        self.kept_specials: dict[str, int] = {}  # those tokens by text

    def _special(self, token) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids, with the special tokens a prompt gets (see the class) unless
        `add_special_tokens` is false."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def keep_in_text(self, tokens) -> None:
        """Keep these special tokens (by text; those the vocabulary lacks, or holds as plain text,
        need nothing) in decoded text, where every other special token is left out: the markers a
        tool-call parser reads (tool_calls.MARKERS), as vLLM decodes a request's special tokens for
        such a parser."""
        special = {added.content: i for i, added in self._tok.get_added_tokens_decoder().items() if added.special}
        self.kept_specials = {text: special[text] for text in tokens if text in special}
        self._kept = frozenset(self.kept_specials.values())

    def decode(self, ids: list[int]) -> str:
        if not self._kept or self._kept.isdisjoint(ids):
            return self._tok.decode(ids, skip_special_tokens=True)
        parts, start = [], 0
        for at, token in enumerate(ids):
            if token in self._kept:
                parts += [self._tok.decode(ids[start:at], skip_special_tokens=True), self.token_text(token)]
                start = at + 1
        parts.append(self._tok.decode(ids[start:], skip_special_tokens=True))
        return "".join(parts)

    @property
    def hidden_specials(self) -> frozenset[int]:
        """The special tokens decoded text leaves out (all but those keep_in_text keeps)."""
        return self._specials - self._kept

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens by name (how logprobs show a token): a token that
        holds part of a character decodes to U+FFFD, as in vLLM."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()


def first_outside_vocab(ids, vocab_size: int) -> int | None:
    """The index of the first of `ids` that is not a token id in [0, vocab_size), or None: the one
    check a prompt, a pin's tokens and /detokenize's ids pass before anything decodes or runs them."""
    return next((i for i, t in enumerate(ids) if not isinstance(t, int) or not 0 <= t < vocab_size), None)
