"""Enough of PromQL to run examples/kvd-alerts.yml against two scrapes of a real kvd.

An expression is parsed with `promql_parser` (Prometheus's grammar) and evaluated at the second
scrape: a selector reads the second; `rate` and `increase` over a range read the change from the
first to the second (no extrapolation, and a series the first scrape lacked has no rate, as in
Prometheus, which needs two samples); `time()` is the second scrape's time. Supported: selectors with any matcher, `rate`, `increase`,
`sum`/`max`/`min`/`count` with `by` or `without`, arithmetic (with `on`/`ignoring`, and `group_left`),
comparisons (filtering, not `bool`),
`and`/`or`/`unless` with `on`/`ignoring`, parentheses and unary minus. Anything else (`offset`,
`histogram_quantile`, ...) raises `Unsupported`; such rules are checked only for the names they
use. Series carry the target labels Prometheus adds at a scrape (`job`, `instance`).
"""

from __future__ import annotations

import operator
import re
import time

import promql_parser
from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset  # of (name, value) pairs, without __name__
Vector = dict  # Labels -> float

COMPARISONS = {"==": operator.eq, "!=": operator.ne, ">": operator.gt, "<": operator.lt, ">=": operator.ge,
               "<=": operator.le}
ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": lambda a, b: a / b if b else float("nan")}
AGGREGATIONS = {"sum": sum, "max": max, "min": min, "count": len}


class Unsupported(Exception):
    """The expression uses PromQL this evaluator does not implement."""


def samples(exposition: str, **target: str) -> dict[str, Vector]:
    """Every sample of a /metrics text by its series name, with the scrape's target labels added."""
    out: dict[str, Vector] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = Labels({**sample.labels, **target}.items())
            out.setdefault(sample.name, {})[labels] = sample.value
    return out


class Scrapes:
    """Two scrapes of the same targets, the second "now" and the first a range earlier: each `rate`
    or `increase` takes the change between them as its range's."""

    def __init__(self, before: dict[str, Vector], after: dict[str, Vector], now: float | None = None) -> None:
        self.before, self.after = before, after
        self.now = time.time() if now is None else now  # what time() gives: the second scrape's time

    def evaluate(self, expr: str) -> Vector | float:
        return self._eval(promql_parser.parse(expr))

    def firing(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """The series an alert with this expression fires for: sorted labels -> value."""
        result = self.evaluate(expr)
        if not isinstance(result, dict):
            raise Unsupported(f"{expr!r} is a scalar, not an alert condition")
        return {tuple(sorted(labels)): value for labels, value in result.items()}

    # ---- the grammar ------------------------------------------------------------------------
    def _eval(self, node):
        kind = type(node).__name__
        if kind == "NumberLiteral":
            return float(node.val)
        if kind == "ParenExpr":
            return self._eval(node.expr)
        if kind == "UnaryExpr":
            inner = self._eval(node.expr)
            return -inner if isinstance(inner, float) else {k: -v for k, v in inner.items()}
        if kind == "VectorSelector":
            return self._select(node, self.after)
        if kind == "Call":
            return self._call(node)
        if kind == "AggregateExpr":
            return self._aggregate(node)
        if kind == "BinaryExpr":
            return self._binary(node)
        raise Unsupported(f"{kind}: {node}")

    def _select(self, selector, scrape: dict[str, Vector]) -> Vector:
        if selector.offset is not None or selector.at is not None:
            raise Unsupported(f"offset or @ in {selector}")
        wanted = selector.matchers.matchers
        out: Vector = {}
        for labels, value in scrape.get(selector.name, {}).items():
            held = dict(labels)
            if all(_matches(m, held.get(m.name, "")) for m in wanted):
                out[labels] = value
        return out

    def _call(self, call) -> Vector:
        name = call.func.name
        if name == "time":
            return self.now
        if name not in ("rate", "increase"):
            raise Unsupported(f"function {name}")
        [matrix] = call.args
        before = self._select(matrix.vector_selector, self.before)
        out: Vector = {}
        for labels, now in self._select(matrix.vector_selector, self.after).items():
            if labels not in before:
                continue  # one sample: no rate yet
            grown = now - before[labels] if now >= before[labels] else now  # a counter reset
            out[labels] = grown / matrix.range.total_seconds() if name == "rate" else grown
        return out

    def _aggregate(self, node) -> Vector:
        op = str(node.op)
        if op not in AGGREGATIONS or node.param is not None:
            raise Unsupported(f"aggregation {op}")
        vector = self._eval(node.expr)
        groups: dict[Labels, list[float]] = {}
        for labels, value in vector.items():
            groups.setdefault(_grouping(labels, node.modifier), []).append(value)
        return {labels: float(AGGREGATIONS[op](values)) for labels, values in groups.items()}

    def _binary(self, node):
        op, left, right = str(node.op), self._eval(node.lhs), self._eval(node.rhs)
        modifier = node.modifier
        if modifier is not None and modifier.return_bool:
            raise Unsupported("comparison with bool")
        if op in ("and", "or", "unless"):
            keys = {_match_key(labels, modifier) for labels in right}
            if op == "and":
                return {k: v for k, v in left.items() if _match_key(k, modifier) in keys}
            if op == "unless":
                return {k: v for k, v in left.items() if _match_key(k, modifier) not in keys}
            seen = {_match_key(labels, modifier) for labels in left}
            return {**left, **{k: v for k, v in right.items() if _match_key(k, modifier) not in seen}}
        apply = COMPARISONS.get(op) or ARITHMETIC.get(op)
        if apply is None:
            raise Unsupported(f"operator {op}")
        comparison = op in COMPARISONS
        if isinstance(left, float) and isinstance(right, float):
            if comparison:
                raise Unsupported("a comparison of two scalars needs bool")
            return apply(left, right)
        if isinstance(right, float) or isinstance(left, float):
            vector, scalar, vector_left = (left, right, True) if isinstance(right, float) else (right, left, False)
            out: Vector = {}
            for labels, value in vector.items():
                got = apply(value, scalar) if vector_left else apply(scalar, value)
                if comparison:
                    if got:
                        out[labels] = value
                else:
                    out[labels] = got
            return out
        by_key = {_match_key(labels, modifier): value for labels, value in right.items()}
        many_to_one = modifier is not None and str(modifier.card).endswith("ManyToOne")  # group_left
        if modifier is not None and str(modifier.card).endswith("OneToMany"):
            raise Unsupported("group_right")
        out = {}
        for labels, value in left.items():
            key = _match_key(labels, modifier)
            if key not in by_key:
                continue
            got = apply(value, by_key[key])
            if comparison:
                if got:
                    out[labels] = value
            else:
                out[labels if many_to_one or modifier is None else key] = got  # group_left keeps the left's
        return out


def _matches(matcher, value: str) -> bool:
    op = str(matcher.op).rsplit(".", 1)[-1]
    if op == "Equal":
        return value == matcher.value
    if op == "NotEqual":
        return value != matcher.value
    found = re.fullmatch(matcher.value, value) is not None
    return found if op == "Re" else not found


def _grouping(labels: Labels, modifier) -> Labels:
    if modifier is None:
        return Labels()
    names = set(modifier.labels)
    include = str(modifier.type).endswith("By")
    return Labels((k, v) for k, v in labels if (k in names) == include)


def _match_key(labels: Labels, modifier) -> Labels:
    matching = modifier.matching if modifier is not None else None
    if matching is None:
        return labels
    names = set(matching.labels)
    include = str(matching.type).endswith("Include")
    return Labels((k, v) for k, v in labels if (k in names) == include)
