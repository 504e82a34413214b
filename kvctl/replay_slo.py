"""`kvctl bench replay --slo`: which replayed runs meet an operator's service-level objectives, and
the one to pick among them (the highest hit ratio, then the lowest first-token p95, then the lowest
end-to-end p95). An objective is a condition on a figure of a run, written as a rollout's stop
conditions are (policies/figure_condition.py), without a baseline: `itl_p95_s <= 0.05`."""

from __future__ import annotations

from typing import Callable, Sequence

from rich.text import Text

from kvctl.daemon.replay.foresight import reads_the_future
from kvctl.policies.figure_condition import FigureCondition

# the figures of a run (ReplayResult, FleetResult) an objective may name
SLO_FIGURES = ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "e2e_p50_s", "e2e_p95_s", "itl_p50_s", "itl_p95_s",
               "hit_ratio", "rejections", "preemptions", "recomputed_after_preemption")
EXAMPLE = "itl_p95_s <= 0.05"


def parse_slo(texts: Sequence[str]) -> list[FigureCondition]:
    """Each text as an objective; ValueError naming `slo` and the text."""
    return [FigureCondition.parse(text, SLO_FIGURES, field="slo", example=EXAMPLE, baseline=False) for text in texts]


def meets(run, objectives: Sequence[FigureCondition]) -> bool:
    """Whether `run` meets every objective (a figure it did not measure meets none)."""
    return all(objective.holds(getattr(run, objective.figure, None)) is True for objective in objectives)


def pick(runs: Sequence, objectives: Sequence[FigureCondition]) -> tuple[list[int], int | None]:
    """(the runs meeting every objective, by index; the pick among them, None where none does). A run
    of `belady` is never among them: it evicts knowing the future, and kvd cannot run it."""
    met = [i for i, run in enumerate(runs) if meets(run, objectives) and not reads_the_future(run.policy)]
    inf = float("inf")

    def rank(i: int) -> tuple:
        run = runs[i]
        return (-run.hit_ratio, inf if run.ttft_p95_s is None else run.ttft_p95_s,
                inf if run.e2e_p95_s is None else run.e2e_p95_s)

    return met, min(met, key=rank, default=None)


def slo_line(runs: Sequence, objectives: Sequence[FigureCondition], picked: tuple[list[int], int | None],
             describe: Callable[[object], str]) -> Text:
    """What `kvctl bench replay` prints of its objectives: how many runs meet them, and the pick
    (`picked`: what `pick` said)."""
    met, best = picked
    said = "SLO " + "; ".join(objective.text for objective in objectives) + ": "
    if best is None:
        return Text(said + "no run meets it")
    run = runs[best]
    figures = [f"hit {run.hit_ratio:.1%}"]
    if run.ttft_p95_s is not None:
        figures.append(f"first token p95 {run.ttft_p95_s:.2f} s")
    if run.e2e_p95_s is not None:
        figures.append(f"end to end p95 {run.e2e_p95_s:.2f} s")
    runnable = sum(not reads_the_future(run.policy) for run in runs)  # (belady's runs are not candidates)
    return Text(said + f"{len(met)} of {runnable} runs meet it; the pick (the highest hit, then the lowest "
                f"first-token p95): {describe(run)} ({', '.join(figures)})")
