"""Whether a grammar can end: the rules that derive some finite string, read from xgrammar's own
EBNF print of a grammar. A rule none of whose alternatives can be completed (a JSON schema whose
definitions require each other, `{"$ref": "#"}`, `rest ::= rest`) lets a stream start a value it
can never close, so it would run to max_tokens; such a grammar is refused before it runs."""

from __future__ import annotations

import re

# xgrammar's print: quoted literals, character classes, embedded regexes (`Regex("...", ...)`), rule
# names, groups, lookaheads `(= ...)`, alternatives and the quantifiers *, +, ?, {m, n}.
_TOKEN = re.compile(r'\s*(?:(?P<lit>"(?:[^"\\]|\\.)*"|Regex\("(?:[^"\\]|\\.)*"(?:,\s*\w+=\w+)*\))'
                    r'|(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<look>\(=)|(?P<rep>\{\s*(?P<lo>\d+)\s*,\s*-?\d+\s*\})'
                    r'|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>[()|*+?]))')
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")


class _Unreadable(Exception):
    """The print holds a construct this reader does not know: nothing is concluded."""


def _tokens(body: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    body = body.rstrip()
    while pos < len(body):
        m = _TOKEN.match(body, pos)
        if m is None or m.end() == pos:
            raise _Unreadable(body[pos:pos + 20])
        kind = m.lastgroup if m.lastgroup != "lo" else "rep"
        out.append((kind, m.group("lo") if kind == "rep" else m.group(kind)))
        pos = m.end()
    return out


class _Expr:
    """A rule body as nested alternatives of sequences; `ends(done)` says whether it derives a
    finite string when the rules in `done` do."""

    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.pos = tokens, 0
        self.tree = self._choice()
        if self.pos != len(tokens):
            raise _Unreadable("trailing tokens")

    def _peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else (None, None)

    def _choice(self):
        alts = [self._seq()]
        while self._peek() == ("op", "|"):
            self.pos += 1
            alts.append(self._seq())
        return ("any", alts)

    def _seq(self):
        items = []
        while True:
            kind, value = self._peek()
            if kind is None or (kind == "op" and value in "|)"):
                return ("all", items)
            self.pos += 1
            if kind == "look":  # a lookahead constrains what follows; it derives nothing itself
                self._choice()
                self._close()
                continue
            if kind == "op" and value == "(":
                item = self._choice()
                self._close()
            elif kind in ("lit", "cls"):
                item = ("leaf",)
            elif kind == "name":
                item = ("rule", value)
            else:
                raise _Unreadable(value)
            kind, value = self._peek()
            if (kind == "op" and value in "*?") or (kind == "rep" and value == "0"):
                self.pos += 1
                item = ("leaf",)  # zero repetitions end at once
            elif (kind == "op" and value == "+") or kind == "rep":
                self.pos += 1
            items.append(item)

    def _close(self):
        if self._peek() != ("op", ")"):
            raise _Unreadable("unclosed group")
        self.pos += 1

    def ends(self, done: set[str], node=None) -> bool:
        node = self.tree if node is None else node
        if node[0] == "leaf":
            return True
        if node[0] == "rule":
            return node[1] in done
        results = (self.ends(done, child) for child in node[1])
        return any(results) if node[0] == "any" else all(results)


def rules_that_never_end(ebnf: str, root: str = "root") -> list[str] | None:
    """The rules reachable from `root` that derive no finite string (root first when it is one of
    them); None when the print cannot be read (then nothing is concluded)."""
    try:
        rules = {}
        for line in ebnf.splitlines():
            m = _RULE.match(line.strip())
            if m is not None:
                rules[m.group(1)] = _Expr(_tokens(m.group(2)))
    except _Unreadable:
        return None
    if root not in rules:
        return None
    done: set[str] = set()
    changed = True
    while changed:  # least fixpoint: a rule ends once one of its alternatives does
        changed = False
        for name, expr in rules.items():
            if name not in done and expr.ends(done):
                done.add(name)
                changed = True
    reachable, stack = {root}, [root]
    while stack:
        for _, ref in _refs(rules[stack.pop()].tree):
            if ref in rules and ref not in reachable:
                reachable.add(ref)
                stack.append(ref)
    never = sorted(n for n in reachable if n not in done)
    return ([root] if root in never else []) + [n for n in never if n != root]


def _refs(node):
    if node[0] == "rule":
        yield node
    elif node[0] in ("any", "all"):
        for child in node[1]:
            yield from _refs(child)
