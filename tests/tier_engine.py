"""An engine on the demo checkpoint with lower tiers attached, and the prompts the tier tests
push through it (`push_out` fills a 12-block device cache so that TEXT_A's blocks leave it)."""

from __future__ import annotations

import pytest

from kvctl.daemon.cache.tiers import build_tiers
from kvctl.daemon.engine.engine import Engine, EngineSettings
from kvctl.daemon.engine.sampling import SamplingParams
from kvctl.daemon.model.demo import ensure_demo_checkpoint
from kvctl.daemon.model.llama import load_model

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
TEXT_A = "The paged cache keeps blocks of sixteen tokens, and this prompt is long enough for several blocks!"
TEXT_B = "Another prompt entirely, different words, which also spans several blocks of sixteen tokens each."
TEXT_C = "A third prompt that pushes the others out of a small device cache, again several blocks long."


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return load_model(ensure_demo_checkpoint(tmp_path_factory.mktemp("state")))


def engine_with(demo, num_blocks=12, settings: dict | None = None, clock=None, **tiers):
    """An engine of `num_blocks` 16-token blocks (EngineSettings fields in `settings`) with the
    tiers named in `tiers` (build_tiers' arguments), keeping and restoring everything."""
    engine = Engine(demo, EngineSettings(num_blocks=num_blocks, block_size=16, **(settings or {})),
                    **({"clock": clock} if clock is not None else {}))
    tiered, _ = build_tiers(engine, tiering="always", **tiers)
    return engine, tiered


def generate(engine, text, demo, params=GREEDY):
    request = engine.add_request(demo.tokenizer.encode(text), params)
    engine.run_until_done()
    engine.cache.audit()
    return request


def push_out(engine, demo):
    generate(engine, TEXT_B, demo)
    generate(engine, TEXT_C, demo)
