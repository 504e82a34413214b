"""The tokenizer, loaded with the `tokenizers` library, and its digest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .config import ModelError


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"model: no tokenizer.json in {str(model_dir)!r}")
        self._tok = HFTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        digest = hashlib.sha256(b"kvctl/tokenizer/v1\0" + path.read_bytes())
        if config_path.is_file():
            digest.update(config_path.read_bytes())
        self.digest = digest.hexdigest()
        self.eos_token_id = self._special(self.config.get("eos_token"))
        self.bos_token_id = self._special(self.config.get("bos_token"))

    def _special(self, token) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()
