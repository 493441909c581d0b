"""Whether a compiled grammar can ever finish: a rule that no finite text completes (`root ::= root`, or a
JSON schema no value satisfies) would leave generation with no allowed token, so it is refused at compile
time instead.

It reads xgrammar's serialized grammar (rules and expressions): expression i is
`data[indptr[i]:indptr[i+1]] = [type, n, *args]` (indptr holds each expression's start). The least fixed
point of "productive" (some finite text completes it) is computed over the rules; every rule reachable
from the root must be productive. An
expression type this code does not know counts as productive, so an xgrammar change can only make the
check miss a case, never refuse a good grammar.
"""

from __future__ import annotations

import json
from typing import Any

_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE, _SEQUENCE, _CHOICES, _TAG_DISPATCH, _REPEAT = range(9)


def dead_rule(grammar: Any) -> str | None:
    """The name of a rule reachable from the root that no finite text completes, or None."""
    try:
        return _dead_rule(grammar)
    except RecursionError:  # expressions nested beyond Python's stack: not checked
        return None


def _dead_rule(grammar: Any) -> str | None:
    try:
        g = json.loads(grammar.serialize_json())
        rules, data, indptr = g["rules"], g["grammar_expr_data"], g["grammar_expr_indptr"]
        root = int(g["root_rule_id"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return None  # not a format this check reads

    def expr(i: int) -> tuple[int, list[int]]:
        e = data[indptr[i] : indptr[i + 1] if i + 1 < len(indptr) else len(data)]
        return e[0], e[2 : 2 + e[1]]

    productive = [False] * len(rules)

    def ok(i: int) -> bool:
        kind, args = expr(i)
        if kind == _RULE:
            return productive[args[0]]
        if kind == _SEQUENCE:
            return all(ok(a) for a in args)
        if kind == _CHOICES:
            return any(ok(a) for a in args)
        if kind == _REPEAT:
            return args[1] == 0 or productive[args[0]]
        if kind == _CLASS:
            return _class_nonempty(args)
        return True  # bytes, `[...]*`, the empty string, tag dispatch, anything newer

    changed = True
    while changed:
        changed = False
        for r, rule in enumerate(rules):
            if not productive[r] and ok(rule[1]):
                productive[r] = changed = True
    for r in _reachable(root, rules, expr):
        if not productive[r]:
            return str(rules[r][0])
    return None


def _class_nonempty(args: list[int]) -> bool:
    """Whether a character class `[negated, lo, hi, lo, hi, ...]` matches any code point."""
    negated, ranges = bool(args[0]), sorted(zip(args[1::2], args[2::2], strict=False))
    if not negated:
        return bool(ranges)
    reach = 0  # code points [0, reach) are excluded so far
    for lo, hi in ranges:
        if lo > reach:
            return True
        reach = max(reach, hi + 1)
    return reach <= 0x10FFFF


def _reachable(root: int, rules: list, expr) -> list[int]:
    seen, frontier = {root}, [rules[root][1]]
    while frontier:
        kind, args = expr(frontier.pop())
        if kind in (_RULE, _REPEAT):
            if args[0] not in seen:
                seen.add(args[0])
                frontier.append(rules[args[0]][1])
        elif kind in (_SEQUENCE, _CHOICES):
            frontier.extend(args)
    return sorted(seen)
