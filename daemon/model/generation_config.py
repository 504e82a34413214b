"""A checkpoint's `generation_config.json`: the tokens that end a reply, and the sampling its
makers recommend.

- `eos_token_id` (a number or a list) joins config.json's. An instruct checkpoint often ends its
  turns with a token config.json does not name (Llama 3's `<|eot_id|>`, Qwen's `<|im_end|>`): a
  server reading config.json alone writes on past the end of the answer.
- `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` become the defaults of a
  request that leaves them out, as vLLM's `--generation-config auto` makes them (Qwen3: 0.6,
  0.95, 20). A request's own values always win. Other fields (`do_sample`, `max_new_tokens`,
  beam settings) are not used, as in vLLM.

kvd's `generation_config` setting: `auto` (the checkpoint's file; none there, none used), `none`
(kvd's own defaults; the EOS tokens are still read, since they say where answers end), or a
path (a folder holding generation_config.json, or the file).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ModelError

FILE = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationConfig:
    """What a checkpoint's generation_config.json says, as kvd uses it."""

    source: str | None = None  # the file read; None: there was none
    eos_token_ids: tuple[int, ...] = ()
    # request defaults, by SamplingParams' names: only the fields the file gives
    sampling: dict = field(default_factory=dict, compare=False)


def _path(model_dir: Path, setting: str) -> Path:
    if setting in ("auto", "none"):
        return Path(model_dir) / FILE
    given = Path(setting)
    return given / FILE if given.is_dir() else given


def read_generation_config(model_dir: Path, setting: str = "auto") -> GenerationConfig:
    """The generation config kvd uses for the checkpoint in `model_dir` under the `setting`
    (module docstring); ModelError naming the file and the field it cannot use."""
    path = _path(model_dir, setting)
    if not path.is_file():
        if setting not in ("auto", "none"):
            raise ModelError(f"generation_config: {setting!r} holds no {FILE}")
        return GenerationConfig()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    eos = raw.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos_ids):
        raise ModelError(f"{path}: field 'eos_token_id' must be a token id or a list of them (got {eos!r})")
    sampling = {}
    if setting != "none":
        for name in SAMPLING_FIELDS:
            value = raw.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or (name == "top_k" and not isinstance(value, int)):
                raise ModelError(f"{path}: field {name!r} must be a {'whole ' if name == 'top_k' else ''}number "
                                 f"(got {value!r})")
            sampling[name] = 0 if name == "top_k" and value < 0 else value  # top_k -1: no cut, as 0
    return GenerationConfig(str(path), tuple(eos_ids), sampling)


def merged_eos(config_ids: tuple[int, ...], generation: GenerationConfig) -> tuple[int, ...]:
    """config.json's EOS tokens, then those only generation_config.json names."""
    return tuple(dict.fromkeys((*config_ids, *generation.eos_token_ids)))
