"""Finds collectives that a compiled XLA program may run in a different order on each device.

XLA's CPU runtime runs the thunks of a computation as their data allow, in parallel, and keeps
the collectives of one computation in program order; a conditional or a while loop whose body
holds a collective is not ordered against the collectives beside it unless data order it. Two
devices can then enter them in opposite orders and wait for each other until the rendezvous
times out (``rendezvous.cc``: "Expected 2 threads to join the rendezvous"). :func:`unordered`
lists every such pair in the optimized HLO text of a program (``compiled.as_text()``).
"""

from __future__ import annotations

import re

COLLECTIVES = frozenset(
    {
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
        "collective-permute",
        "collective-broadcast",
        "all-reduce-start",
        "all-gather-start",
        "collective-permute-start",
        "send",
        "recv",
    }
)
# Attributes that name the computations an instruction runs (not reductions' to_apply).
_NESTED = re.compile(
    r"\b(branch_computations|true_computation|false_computation|body|condition|calls)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")


def _parse(text: str) -> dict[str, list[dict]]:
    """{computation: [{name, opcode, operands, control, calls}]} of an HLO module's text."""
    computations, current = {}, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("(")[0]:
            current = computations.setdefault(header.group(1), [])
            continue
        found = _INSTRUCTION.match(line)
        if current is None or not found:
            continue
        name, rest = found.groups()
        opcode = _OPCODE.search(" " + rest)
        if not opcode:
            continue
        start = opcode.end()  # operands: up to the bracket that closes the opcode's
        depth, end = 1, start
        while end < len(" " + rest) and depth:
            depth += {"(": 1, ")": -1}.get((" " + rest)[end], 0)
            end += 1
        operands = re.findall(r"%([\w.\-]+)", (" " + rest)[start:end])
        attributes = (" " + rest)[end:]
        control = re.search(r"control-predecessors=\{([^}]*)\}", attributes)
        calls = []
        for _, value in _NESTED.findall(attributes):
            calls += re.findall(r"%?([\w.\-]+)", value.strip("{}"))
        current.append(
            {
                "name": name,
                "opcode": opcode.group(1),
                "operands": operands,
                "control": re.findall(r"%([\w.\-]+)", control.group(1)) if control else [],
                "calls": calls,
            }
        )
    return computations


def unordered(text: str) -> list[tuple[str, str, str]]:
    """``(computation, a, b)`` for each pair of instructions of one computation that run
    collectives, at least one of them inside a nested computation (conditional, while, call),
    with no data or control path between them: the pairs whose order may differ per device."""
    computations = _parse(text)
    has_collective: dict[str, bool] = {}

    def holds(computation: str) -> bool:
        if computation not in has_collective:
            has_collective[computation] = False  # recursion guard
            has_collective[computation] = any(
                i["opcode"] in COLLECTIVES or any(holds(c) for c in i["calls"] if c in computations)
                for i in computations.get(computation, [])
            )
        return has_collective[computation]

    pairs = []
    for computation, instructions in computations.items():
        nested = {
            i["name"]
            for i in instructions
            if i["opcode"] not in COLLECTIVES and any(holds(c) for c in i["calls"])
        }
        if not nested:
            continue
        direct = {i["name"] for i in instructions if i["opcode"] in COLLECTIVES}
        before = {i["name"]: set(i["operands"]) | set(i["control"]) for i in instructions}
        ancestors: dict[str, set[str]] = {}
        for i in instructions:  # HLO text lists operands before their users
            found = set()
            for parent in before[i["name"]]:
                found |= {parent} | ancestors.get(parent, set())
            ancestors[i["name"]] = found
        members = sorted(nested | direct)
        for x, a in enumerate(members):
            for b in members[x + 1 :]:
                if a not in nested and b not in nested:
                    continue  # two plain collectives: the runtime keeps them in order
                if a not in ancestors[b] and b not in ancestors[a]:
                    pairs.append((computation, a, b))
    return pairs
