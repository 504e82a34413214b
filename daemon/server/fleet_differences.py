"""Where the replicas behind kvd router differ in what makes one request's answer depend on which
replica takes it: their software (software.py) and, among the replicas of one model, its weights,
formats, template, sampling defaults and context limit.

A rolling upgrade passes through such a fleet, and a canary is one on purpose; the router's
`/admin/status` names each difference (`differences`) so `kvctl status` shows while it lasts, and
when an upgrade stopped half way. Replicas that do not answer are left out: they are not serving.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

NUMBERS = "a request may take other tokens on each, seeded or greedy"
NOT_SAID = "not said (an older kvd)"
MISSING = object()  # value_at: the status has no such field


def value_at(status: dict, key: str) -> object:
    """The value at `key`'s dotted path in `status`, or MISSING."""
    value: object = status
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


@dataclass(frozen=True)
class Field:
    """A figure of a replica's `/admin/status` that should agree across the fleet."""
    key: str  # its path in the status, dotted (what `differences` names it by)
    label: str  # as an operator reads it
    why: str  # what the difference does to requests
    per_model: bool  # compared among the replicas of one model only (else across the fleet)
    shown: Callable[[object], str] = str

    def read(self, status: dict) -> str:
        value = value_at(status, self.key)
        if value is MISSING:
            return NOT_SAID
        return "not installed" if value is None and self.key.startswith("software.") else self.shown(value)


def _sampling(values: object) -> str:
    return ", ".join(f"{name} {value}" for name, value in sorted(values.items())) if values else "none"


FIELDS = (
    Field("software.kvd", "kvd version", NUMBERS, per_model=False),
    Field("software.torch", "torch build", NUMBERS, per_model=False),
    Field("software.triton", "triton version", NUMBERS, per_model=False),
    Field("software.tokenizers", "tokenizers version", "a prompt may tokenize otherwise on each", per_model=False),
    Field("software.llguidance", "llguidance version", "a grammar may allow other tokens on each", per_model=False),
    Field("model.revision", "checkpoint revision", "each answers from other weights", per_model=True,
          shown=lambda revision: str(revision)[:12]),
    Field("model.dtype", "model dtype", NUMBERS, per_model=True),
    Field("cache.dtype", "cache format", NUMBERS, per_model=True),
    Field("model.chat_template.digest", "chat template", "a chat renders to other prompts on each", per_model=True,
          shown=lambda digest: str(digest)[:12]),
    Field("model.sampling_defaults.values", "sampling defaults",
          "a request that leaves a field out samples otherwise on each", per_model=True,
          shown=lambda values: _sampling(values) if isinstance(values, dict) else json.dumps(values)),
    Field("model.max_model_len", "context limit", "a long request fits some of them only", per_model=True,
          shown=lambda tokens: f"{tokens:,} tokens" if isinstance(tokens, int) else str(tokens)),
)


def fleet_differences(statuses: list[tuple[str, dict]]) -> list[dict]:
    """Each field in which the answering replicas (name, status) differ: {"field", "label", "why",
    "model" (None for software), "values": [{"value", "replicas"}], "held": those as a line ("2.13.0
    on a, b; 2.12.0 on c")}, the value most replicas hold first. Empty when they all agree, or
    fewer than two answer."""
    models: dict[str, list[tuple[str, dict]]] = {}
    for name, status in statuses:
        models.setdefault(str((status.get("model") or {}).get("name")), []).append((name, status))
    out = []
    for field in FIELDS:
        groups = sorted(models.items()) if field.per_model else [(None, statuses)]
        for model, members in groups:
            held: dict[str, list[str]] = {}
            for name, status in members:
                held.setdefault(field.read(status), []).append(name)
            if len(held) < 2:
                continue
            values = sorted(held.items(), key=lambda item: (-len(item[1]), item[0]))
            out.append({"field": field.key, "label": field.label if model is None or len(models) == 1
                        else f"{field.label} of {model}", "why": field.why, "model": model,
                        "values": [{"value": value, "replicas": names} for value, names in values],
                        "held": "; ".join(f"{value} on {', '.join(names)}" for value, names in values)})
    return out
