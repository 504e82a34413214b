"""The engine's draws scripted: a test that needs a reply of its choosing from the demo model
(whose weights are random) decides each sampled token itself; everything after the draw runs as
served."""

from __future__ import annotations

from typing import Callable


def script_draws(monkeypatch, choose: Callable) -> None:
    """Each token the engine draws (sampling.draw_tokens) becomes `choose(scores, params, seed,
    sample_index, step)`, with the row's scores as the engine would draw from them (a grammar's
    mask applied)."""
    from kvctl.daemon.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "draw_tokens", lambda scores, draws: [
        choose(scores[i], d.params, d.seed, d.sample_index, d.step) for i, d in enumerate(draws)])
