"""Hide control strings in user-supplied strings behind per-request placeholders.

Before the template runs, every string a client supplied (message bodies, tool
call names and arguments, tool results, tool schemas, dictionary keys
included) has each control string it contains replaced by a placeholder
``@@<nonce>.<k>@@`` (``k`` indexes the original text). So is a *partial*
control string at either edge of a string (``"...<|im_"`` at the end,
``"end|>..."`` at the start, also inside surrounding whitespace): a template
that glues two strings together, or trims one, cannot complete a control
string out of client text. The rendered prompt then holds control strings
from the template only; the placeholders are put back (as text) after the
prompt is cut at those control strings.

The nonce is 20 random decimal digits per request; a client string that
contains it is refused (ValueError). Placeholders use only ``@``, digits and
``.``, which every template filter we know leaves alone (``trim``, ``tojson``,
``upper``, HTML escaping), and ``vocab.load_vocab`` checks that no control
string could match inside one.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

from deepinfer.recipe.vocab import Vocab


_PLACEHOLDER = re.compile(r"@@(\d{20})\.(\d+)@@")


def new_nonce() -> str:
    """20 random decimal digits (about 66 bits), from the OS's CSPRNG."""
    return f"{secrets.randbelow(10**20):020d}"


@dataclass
class EdgeSets:
    """Proper prefixes and suffixes of the control strings (what an edge may not end / start with)."""

    prefixes: frozenset[str]
    suffixes: frozenset[str]
    longest: int  # characters in the longest control string

    @classmethod
    def of(cls, controls) -> "EdgeSets":
        pre, suf, longest = set(), set(), 0
        for c in controls:
            longest = max(longest, len(c))
            for k in range(1, len(c)):
                pre.add(c[:k])
                suf.add(c[k:])
        return cls(frozenset(pre), frozenset(suf), longest)

    def tail(self, s: str, end: int) -> int:
        """Length of the longest ``s[:end]`` tail that starts a control string (0 if none)."""
        for k in range(min(self.longest - 1, end), 0, -1):
            if s[end - k : end] in self.prefixes:
                return k
        return 0

    def head(self, s: str, start: int) -> int:
        """Length of the longest ``s[start:]`` head that ends a control string (0 if none)."""
        for k in range(min(self.longest - 1, len(s) - start), 0, -1):
            if s[start : start + k] in self.suffixes:
                return k
        return 0


@dataclass
class Placeholders:
    """One request's placeholders: ``hide`` client strings, ``restore`` rendered text."""

    vocab: Vocab
    edges: EdgeSets
    nonce: str = field(default_factory=new_nonce)
    originals: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not re.fullmatch(r"\d{20}", self.nonce):
            raise ValueError("the nonce must be 20 decimal digits")


    def hide(self, tree):
        """A copy of ``tree`` (dicts, lists, scalars) with every string made safe.

        Values get whole and edge control strings hidden; dictionary keys
        only whole ones (templates look keys up by name, and ``tojson``
        quotes them, so their edges never touch template text).
        Raises ValueError if a string contains the nonce.
        """
        values: dict[str, None] = {}
        keys: dict[str, None] = {}
        _collect(tree, values, keys)
        unique = list(values) + list(keys)
        for s in unique:
            if self.nonce in s:
                raise ValueError("message text collides with the request's placeholder nonce; retry the request")
        spans = self.vocab.spans(unique)
        n = len(values)
        hidden_values = {s: self._hide(s, sp, True) for s, sp in zip(unique[:n], spans[:n])}
        hidden_keys = {s: self._hide(s, sp, False) for s, sp in zip(unique[n:], spans[n:])}
        return _rebuild(tree, hidden_values, hidden_keys)

    def restore(self, text: str) -> str:
        """``text`` with this request's placeholders replaced by the originals.

        Raises ValueError if a placeholder was damaged by the template (the
        nonce survives outside a whole placeholder).
        """
        def original(m: re.Match) -> str:
            return self.originals[int(m.group(2))] if m.group(1) == self.nonce else m.group()

        out = _PLACEHOLDER.sub(original, text)
        if self.nonce in out:
            raise ValueError("the chat template altered message text in a way the encoder cannot follow")
        return out

    def _hide(self, s: str, spans, edges: bool) -> str:
        cuts = [(sp.start, sp.end) for sp in spans]
        if edges:
            core_start, core_end = len(s) - len(s.lstrip()), len(s.rstrip())
            for end in {len(s), core_end}:
                if k := self.edges.tail(s, end):
                    cuts.append((end - k, end))
            for start in {0, core_start}:
                if k := self.edges.head(s, start):
                    cuts.append((start, start + k))
        if not cuts:
            return s
        parts, pos = [], 0
        for start, end in _merge(cuts):
            parts.append(s[pos:start])
            parts.append(f"@@{self.nonce}.{len(self.originals)}@@")
            self.originals.append(s[start:end])
            pos = end
        parts.append(s[pos:])
        return "".join(parts)


def _merge(cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching ``[start, end)`` ranges merged into disjoint ones."""
    merged: list[list[int]] = []
    for start, end in sorted(cuts):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _collect(tree, values: dict, keys: dict) -> None:
    """Every distinct string of ``tree``: values into ``values``, dictionary keys into ``keys``."""
    if isinstance(tree, str):
        values[tree] = None
    elif isinstance(tree, dict):
        for k, v in tree.items():
            if isinstance(k, str):
                keys[k] = None
            _collect(v, values, keys)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _collect(v, values, keys)


def _rebuild(tree, values: dict[str, str], keys: dict[str, str]):
    if isinstance(tree, str):
        return values[tree]
    if isinstance(tree, dict):
        return {keys.get(k, k) if isinstance(k, str) else k: _rebuild(v, values, keys) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_rebuild(v, values, keys) for v in tree]
    return tree
