#!/usr/bin/env python3
"""Check the module tree of each Rust crate for import cycles between sibling modules.

Usage:
    python3 scripts/check-module-cycles.py [-v] [--dot] [CRATE_ROOT ...]
    python3 scripts/check-module-cycles.py --self-test

CRATE_ROOT defaults to src/lib.rs, ingest/src/lib.rs and, when they exist, engine/src/lib.rs,
generate/src/lib.rs, store/src/lib.rs, kernels/src/lib.rs and fuzz/src/lib.rs,
relative to the repository root. Exit status: 0 no cycles, 1 cycles found (or the self-test
failed), 2 usage or input errors.

What it does, per crate:

* Discovers the module tree from `mod x;` declarations (any visibility): `x.rs` or `x/mod.rs`,
  the 2018 layout `parent/x.rs` for `mod x;` in `parent.rs`, and `#[path = "..."]`. Inline
  modules (`mod x { ... }`) are not tree nodes; their contents count as part of their file.
  Modules gated by exactly `#[cfg(test)]` (inline `mod tests { ... }` blocks or `mod x;`
  files, whatever the name) are skipped entirely.
* Strips comments (including doc comments, so doc links such as [`crate::api`] do not count),
  string, raw-string and char literals, then collects references to modules of the same crate:
  `use` trees (nested braces, multiple lines, `self`, globs, `as`), paths in code
  (`crate::a::f()`, `super::x`, `self::x`), 2018 uniform paths that start with a child module,
  and paths that start with a name the file imported with `use`.
* Resolves each path to the deepest module that exists in the tree (an item resolves to the
  module that contains it), then lifts the edge from module A to module B to the two distinct
  children of their lowest common ancestor. A child referring to one of its ancestors, and a
  module referring to its own descendants, are not edges.
* Reports every strongly connected component with more than one module, at every level of the
  tree, with one example reference per edge (all of them with -v).
"""

from __future__ import annotations

import argparse
import bisect
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# every crate of the tree: the workspace's members and the fuzz crate
DEFAULT_ROOTS = [
    "src/lib.rs",
    "tools/src/lib.rs",
    "cli/src/lib.rs",
    "engine/src/lib.rs",
    "generate/src/lib.rs",
    "ingest/src/lib.rs",
    "store/src/lib.rs",
    "kernels/src/lib.rs",
    "fuzz/src/lib.rs",
]
OPTIONAL_DEFAULT_ROOTS = {
    "engine/src/lib.rs",
    "generate/src/lib.rs",
    "store/src/lib.rs",
    "kernels/src/lib.rs",
    "fuzz/src/lib.rs",
}

IDENT = r"(?:r#)?[A-Za-z_][A-Za-z0-9_]*"
VIS = r"(?:pub\s*(?:\(\s*[^()]*\))?\s+)?"
ATTR = r"#\s*\[[^\]]*\]"

Mod = tuple  # a module path from the crate root, e.g. ("query", "retrieve"); () is the root


# --------------------------------------------------------------------------------------------
# Lexing: blank out comments and literals, keeping offsets and line numbers intact.
# --------------------------------------------------------------------------------------------


def _blank(chars: list[str], start: int, end: int) -> None:
    for k in range(start, end):
        if chars[k] != "\n":
            chars[k] = " "


def strip_comments_and_literals(text: str) -> tuple[str, dict[int, str]]:
    """Return (masked text, {offset of opening quote: string value}).

    Comments become spaces; string literals keep their quotes but their contents become
    spaces; char literals become spaces. Newlines are kept, so offsets and lines match.
    """
    chars = list(text)
    strings: dict[int, str] = {}
    n = len(text)
    i = 0

    def ident_char(c: str) -> bool:
        return c.isalnum() or c == "_"

    while i < n:
        c = text[i]
        if c == "/" and i + 1 < n and text[i + 1] == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            _blank(chars, i, j)
            i = j
        elif c == "/" and i + 1 < n and text[i + 1] == "*":
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            _blank(chars, i, j)
            i = j
        elif c in "rbc" and (i == 0 or not ident_char(text[i - 1])):
            m = re.compile(r'(?:br|cr|r)(#*)"').match(text, i)
            if m:  # raw string
                hashes = m.group(1)
                q = m.end() - 1
                close = text.find('"' + hashes, q + 1)
                close = n - 1 if close < 0 else close
                strings[q] = text[q + 1 : close]
                _blank(chars, q + 1, close)
                i = close + 1 + len(hashes)
            else:
                i += 1  # an identifier, or b"..."/c"..." handled when we reach the quote
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(j, n - 1)
            strings[i] = text[i + 1 : j]
            _blank(chars, i + 1, j)
            i = j + 1
        elif c == "'":
            if i + 1 < n and text[i + 1] == "\\":  # escaped char literal: '\n', '\'', '\u{..}'
                j = text.find("'", i + 3)
                j = n - 1 if j < 0 else j
                _blank(chars, i, j + 1)
                i = j + 1
            elif i + 2 < n and text[i + 2] == "'":  # plain char literal: 'a', '{', '"'
                _blank(chars, i, i + 3)
                i += 3
            else:  # lifetime or label
                i += 1
        elif ident_char(c):
            j = i + 1
            while j < n and ident_char(text[j]):
                j += 1
            i = j
        else:
            i += 1
    return "".join(chars), strings


def matching_brace(text: str, open_at: int) -> int:
    """Offset of the `}` closing the `{` at open_at (len(text) - 1 when unbalanced)."""
    depth = 0
    for k in range(open_at, len(text)):
        ch = text[k]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(text) - 1


# --------------------------------------------------------------------------------------------
# One source file, preprocessed.
# --------------------------------------------------------------------------------------------

CFG_TEST_MOD = re.compile(
    r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]\s*(?:" + ATTR + r"\s*)*" + VIS + r"mod\s+(" + IDENT + r")\s*([{;])"
)
INLINE_MOD = re.compile(r"(?<![\w$])" + VIS + r"mod\s+(" + IDENT + r")\s*\{")
MOD_DECL = re.compile(r"((?:" + ATTR + r"\s*)*)" + VIS + r"(?<![\w$])mod\s+(" + IDENT + r")\s*;")
PATH_ATTR = re.compile(r'#\s*\[\s*path\s*=\s*"')


def unraw(name: str) -> str:
    return name[2:] if name.startswith("r#") else name


@dataclass
class SourceFile:
    path: Path
    text: str  # masked: comments, literals and #[cfg(test)] modules blanked
    strings: dict[int, str]
    inline: list[tuple[int, int, str]]  # (body start, body end, name) of inline modules
    line_starts: list[int]
    test_file_mods: set[str] = field(default_factory=set)

    @classmethod
    def load(cls, path: Path) -> "SourceFile":
        raw = path.read_text(encoding="utf-8", errors="replace")
        masked, strings = strip_comments_and_literals(raw)
        chars = list(masked)
        test_file_mods: set[str] = set()
        pos = 0
        while True:
            m = CFG_TEST_MOD.search(masked, pos)
            if not m:
                break
            if m.group(2) == "{":
                end = matching_brace(masked, m.end() - 1) + 1
            else:
                test_file_mods.add(unraw(m.group(1)))
                end = m.end()
            _blank(chars, m.start(), end)
            masked = "".join(chars)
            pos = end
        inline = []
        for m in INLINE_MOD.finditer(masked):
            open_at = m.end() - 1
            inline.append((open_at, matching_brace(masked, open_at), unraw(m.group(1))))
        line_starts = [0] + [k + 1 for k, ch in enumerate(raw) if ch == "\n"]
        return cls(path, masked, strings, inline, line_starts, test_file_mods)

    def line(self, offset: int) -> int:
        return bisect.bisect_right(self.line_starts, offset)

    def inline_stack(self, offset: int) -> tuple[str, ...]:
        return tuple(name for start, end, name in self.inline if start < offset < end)


# --------------------------------------------------------------------------------------------
# Module tree discovery.
# --------------------------------------------------------------------------------------------


@dataclass
class Module:
    path: Mod
    file: Path | None  # None for an inline module that only exists to hold file modules
    mod_rs: bool  # children are looked up beside the file (lib.rs, main.rs, mod.rs, #[path])
    children: dict[str, "Module"] = field(default_factory=dict)
    source: SourceFile | None = None


@dataclass
class Crate:
    name: str
    root_file: Path
    modules: dict[Mod, Module]
    warnings: list[str]


def crate_name(root_file: Path) -> str:
    for d in [root_file.parent, *root_file.parent.parents]:
        manifest = d / "Cargo.toml"
        if manifest.is_file():
            try:
                data = tomllib.loads(manifest.read_text(encoding="utf-8"))
                name = data.get("package", {}).get("name")
                if name:
                    return name
            except (tomllib.TOMLDecodeError, OSError):
                pass
            return d.name
    return root_file.parent.name


def discover(root_file: Path) -> Crate:
    root_file = root_file.resolve()
    warnings: list[str] = []
    root = Module((), root_file, True)
    modules: dict[Mod, Module] = {(): root}
    queue = [root]
    while queue:
        mod = queue.pop(0)
        if mod.file is None:
            continue
        src = SourceFile.load(mod.file)
        mod.source = src
        base = mod.file.parent if mod.mod_rs else mod.file.parent / mod.file.stem
        for m in MOD_DECL.finditer(src.text):
            name = unraw(m.group(2))
            stack = src.inline_stack(m.start(2))
            attrs = m.group(1)
            path_value = None
            pa = PATH_ATTR.search(attrs)
            if pa:
                path_value = src.strings.get(m.start(1) + pa.end() - 1)
            if path_value is not None:
                rel_dir = mod.file.parent if not stack else base.joinpath(*stack)
                candidates = [rel_dir / path_value]
            else:
                d = base.joinpath(*stack)
                candidates = [d / f"{name}.rs", d / name / "mod.rs"]
            found = [c for c in candidates if c.is_file()]
            if not found:
                warnings.append(
                    f"{rel(mod.file)}:{src.line(m.start(2))}: no file for `mod {name};` "
                    f"(looked for {', '.join(str(rel(c)) for c in candidates)})"
                )
                continue
            if len(found) > 1:
                warnings.append(f"{rel(mod.file)}: both {rel(found[0])} and {rel(found[1])} exist")
            parent = mod
            for inl in stack:  # file modules declared inside inline modules
                p = parent.path + (inl,)
                if p not in modules:
                    modules[p] = Module(p, None, False)
                    parent.children[inl] = modules[p]
                parent = modules[p]
            path = parent.path + (name,)
            child = Module(path, found[0].resolve(), path_value is not None or found[0].name == "mod.rs")
            if path in modules:
                warnings.append(f"{rel(mod.file)}: module {'::'.join(path)} declared twice")
                continue
            modules[path] = child
            parent.children[name] = child
            queue.append(child)
    return Crate(crate_name(root_file), root_file, modules, warnings)


# --------------------------------------------------------------------------------------------
# References.
# --------------------------------------------------------------------------------------------

USE_STMT = re.compile(r"(?<![\w$])use\s")
USE_TOKEN = re.compile(r"\s*(::|\{|\}|,|\*|" + IDENT + r"|\S)")
CODE_PATH = re.compile(
    r"(?<![\w$])(?<!::)(::\s*)?(" + IDENT + r"(?:\s*::\s*" + IDENT + r")+)"
)


@dataclass(frozen=True)
class Ref:
    file: Path
    line: int
    text: str

    def __str__(self) -> str:
        return f"{rel(self.file)}:{self.line}: {self.text}"


@dataclass
class UseLeaf:
    segs: list[str]
    alias: str | None
    offset: int
    glob: bool
    extern: bool  # leading `::` (2018: an extern crate)


def parse_use(src: SourceFile, start: int) -> tuple[int, list[UseLeaf]]:
    """Parse the use tree after `use ` at start. Returns (offset after `;`, leaves)."""
    depth, end = 0, start
    while end < len(src.text):
        ch = src.text[end]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == ";" and depth <= 0:
            break
        end += 1
    body = src.text[start:end]
    if "$" in body:  # inside macro_rules: `$crate` is the crate of the call site
        return end + 1, []
    tokens = [(m.group(1), start + m.start(1)) for m in USE_TOKEN.finditer(body)]
    leaves: list[UseLeaf] = []
    extern = bool(tokens) and tokens[0][0] == "::"

    def tree(i: int, prefix: list[str]) -> int:
        segs: list[str] = []
        if i < len(tokens) and tokens[i][0] == "::":
            i += 1
        while i < len(tokens):
            tok, off = tokens[i]
            if tok == "{":
                i += 1
                while i < len(tokens) and tokens[i][0] != "}":
                    j = tree(i, prefix + segs)
                    i = j + 1 if j == i else j  # no progress: skip a stray token
                    if i < len(tokens) and tokens[i][0] == ",":
                        i += 1
                return i + 1
            if tok == "*":
                leaves.append(UseLeaf(prefix + segs, None, off, True, extern))
                return i + 1
            if re.fullmatch(IDENT, tok):
                segs.append(unraw(tok))
                i += 1
                if i < len(tokens) and tokens[i][0] == "::":
                    i += 1
                    continue
                alias = segs[-1]
                path = prefix + segs
                if segs == ["self"] and prefix:
                    path, alias = prefix, prefix[-1]
                if i + 1 < len(tokens) and tokens[i][0] == "as":
                    alias = unraw(tokens[i + 1][0])
                    i += 2
                leaves.append(UseLeaf(path, None if alias == "_" else alias, off, False, extern))
                return i
            return i
        return i

    i = 0
    while i < len(tokens):
        j = tree(i, [])
        i = j if j > i else i + 1
    return end + 1, leaves


class Resolver:
    def __init__(self, crate: Crate, mod: Module):
        self.crate = crate
        self.mod = mod
        self.aliases: dict[str, tuple[str, ...]] = {}

    def absolute(self, segs: list[str], logical: Mod) -> tuple[str, ...] | None:
        """Absolute path (from the crate root) of segs used inside logical, or None if the path
        does not point into this crate."""
        if not segs:
            return None
        first = segs[0]
        if first == "crate":
            return tuple(segs[1:])
        if first in ("self", "super"):
            base = list(logical)
            k = 0
            while k < len(segs) and segs[k] in ("self", "super"):
                if segs[k] == "super":
                    if not base:
                        return None
                    base.pop()
                k += 1
            return tuple(base) + tuple(segs[k:])
        node = self.crate.modules.get(logical)
        if node is not None and first in node.children:  # 2018 uniform path to a child
            return logical + tuple(segs)
        if first in self.aliases:
            return self.aliases[first] + tuple(segs[1:])
        return None

    def deepest(self, abs_path: tuple[str, ...]) -> Mod:
        node = self.crate.modules[()]
        for seg in abs_path:
            nxt = node.children.get(seg)
            if nxt is None:
                break
            node = nxt
        return node.path


def references(crate: Crate, mod: Module) -> list[tuple[Mod, Ref]]:
    """(target module, reference) for every in-crate path in mod's file."""
    src = mod.source
    assert src is not None
    resolver = Resolver(crate, mod)
    out: list[tuple[Mod, Ref]] = []
    chars = list(src.text)

    leaves: list[tuple[UseLeaf, Mod]] = []
    for m in USE_STMT.finditer(src.text):
        end, ls = parse_use(src, m.end())
        _blank(chars, m.start(), min(end, len(chars)))
        logical = mod.path + src.inline_stack(m.start())
        leaves.extend((leaf, logical) for leaf in ls)

    # Two passes so that `use a::b;` after `use crate::a;` resolves through the alias.
    resolved: dict[int, tuple[str, ...]] = {}
    for _ in range(2):
        for k, (leaf, logical) in enumerate(leaves):
            if k in resolved or leaf.extern:
                continue
            absolute = resolver.absolute(leaf.segs, logical)
            if absolute is None:
                continue
            resolved[k] = absolute
            if leaf.alias and not leaf.glob:
                resolver.aliases.setdefault(leaf.alias, absolute)
    for k, (leaf, _) in enumerate(leaves):
        if k in resolved:
            text = "use " + "::".join(leaf.segs) + ("::*" if leaf.glob else "")
            out.append((resolver.deepest(resolved[k]), Ref(src.path, src.line(leaf.offset), text)))

    code = "".join(chars)
    for m in CODE_PATH.finditer(code):
        if m.group(1):  # `::a::b`: an extern crate
            continue
        segs = [unraw(s.strip()) for s in m.group(2).split("::")]
        logical = mod.path + src.inline_stack(m.start())
        absolute = resolver.absolute(segs, logical)
        if absolute is None:
            continue
        text = "::".join(segs)
        out.append((resolver.deepest(absolute), Ref(src.path, src.line(m.start(2)), text)))
    return out


# --------------------------------------------------------------------------------------------
# Graph.
# --------------------------------------------------------------------------------------------


@dataclass
class Level:
    crate: Crate
    parent: Mod
    nodes: list[str]
    edges: dict[tuple[str, str], list[Ref]] = field(default_factory=dict)


def build_levels(crate: Crate) -> dict[Mod, Level]:
    levels: dict[Mod, Level] = {}
    for path, mod in crate.modules.items():
        if mod.children:
            levels[path] = Level(crate, path, sorted(mod.children))
    for path, mod in sorted(crate.modules.items()):
        if mod.source is None:
            continue
        for target, ref in references(crate, mod):
            a, b = path, target
            if a == b or a[: len(b)] == b or b[: len(a)] == a:
                continue  # same module, child -> ancestor, or parent -> descendant
            k = 0
            while a[k] == b[k]:
                k += 1
            level = levels[a[:k]]
            level.edges.setdefault((a[k], b[k]), []).append(ref)
    for level in levels.values():
        for key, refs in level.edges.items():
            level.edges[key] = sorted(set(refs), key=lambda r: (str(r.file), r.line, r.text))
    return levels


def strongly_connected(nodes: list[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in sorted(edges):
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return sorted(out)


def shortest_cycle(start: str, members: set[str], edges: set[tuple[str, str]]) -> list[str]:
    prev: dict[str, str] = {}
    frontier, seen = [start], {start}
    while frontier:
        nxt = []
        for v in frontier:
            for a, b in sorted(edges):
                if a != v or b not in members:
                    continue
                if b == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if b not in seen:
                    seen.add(b)
                    prev[b] = v
                    nxt.append(b)
        frontier = nxt
    return [start]


def edges_to_break(
    members: list[str], edges: list[tuple[str, str]], weight: dict[tuple[str, str], int]
) -> tuple[list[tuple[str, str]], bool]:
    """A smallest set of edges whose removal leaves members acyclic, with the fewest references
    among those. Returns (edges, exact); falls back to a greedy choice on huge components."""
    nodes = set(members)
    budget = [200_000]

    def any_cycle(active: set[tuple[str, str]]) -> list[tuple[str, str]] | None:
        best = None
        for start in sorted(nodes):
            cyc = shortest_cycle(start, nodes, active)
            if len(cyc) > 1 and (best is None or len(cyc) < len(best)):
                best = cyc
        return None if best is None else list(zip(best, best[1:]))

    def search(active: set[tuple[str, str]], removed: list[tuple[str, str]], k: int, found: list) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            return
        cyc = any_cycle(active)
        if cyc is None:
            found.append(sorted(removed))
            return
        if k == 0:
            return
        for e in cyc:
            search(active - {e}, removed + [e], k - 1, found)

    for k in range(1, len(edges) + 1):
        found: list[list[tuple[str, str]]] = []
        search(set(edges), [], k, found)
        if budget[0] < 0:
            break
        if found:
            return min(found, key=lambda es: (sum(weight[e] for e in es), es)), True
    # Greedy: repeatedly drop the lightest edge of a shortest remaining cycle.
    active, removed = set(edges), []
    while (cyc := any_cycle(active)) is not None:
        e = min(cyc, key=lambda e: (weight[e], e))
        active.discard(e)
        removed.append(e)
    return sorted(removed), False


@dataclass
class Cycle:
    level: Level
    members: list[str]
    edges: list[tuple[str, str]]


@dataclass
class Report:
    crates: list[Crate]
    levels: list[Level]
    cycles: list[Cycle]

    @property
    def module_count(self) -> int:
        return sum(len(c.modules) - 1 for c in self.crates)

    @property
    def edge_count(self) -> int:
        return sum(len(lv.edges) for lv in self.levels)


def analyse(root_files: list[Path]) -> Report:
    crates, levels, cycles = [], [], []
    for root in root_files:
        crate = discover(root)
        crates.append(crate)
        for path, level in sorted(build_levels(crate).items()):
            levels.append(level)
            edges = set(level.edges)
            for comp in strongly_connected(level.nodes, edges):
                if len(comp) > 1:
                    inside = sorted(e for e in edges if e[0] in comp and e[1] in comp)
                    cycles.append(Cycle(level, comp, inside))
    return Report(crates, levels, cycles)


# --------------------------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------------------------


def rel(p: Path) -> Path:
    try:
        return Path(os.path.relpath(p))
    except ValueError:
        return p


def level_name(level: Level) -> str:
    return "crate root" if not level.parent else "module " + "::".join(level.parent)


def print_cycles(report: Report, verbose: bool, out) -> None:
    print(f"import cycles found: {len(report.cycles)}", file=out)
    for cyc in report.cycles:
        lv = cyc.level
        print(file=out)
        print(
            f"{lv.crate.name} ({rel(lv.crate.root_file)}), {level_name(lv)}: "
            f"{len(cyc.members)} modules in a cycle: {', '.join(cyc.members)}",
            file=out,
        )
        print("  cycle: " + " -> ".join(shortest_cycle(cyc.members[0], set(cyc.members), set(cyc.edges))), file=out)
        for a, b in cyc.edges:
            refs = lv.edges[(a, b)]
            print(f"  {a} -> {b}  ({len(refs)} reference{'s' if len(refs) != 1 else ''})", file=out)
            for r in refs if verbose else refs[:1]:
                print(f"      {r}", file=out)
        weight = {e: len(lv.edges[e]) for e in cyc.edges}
        cut, exact = edges_to_break(cyc.members, cyc.edges, weight)
        what = "fewest edges, then fewest references" if exact else "greedy, may not be minimal"
        print(f"  removing these {len(cut)} edge(s) breaks it ({what}): "
              + ", ".join(f"{a} -> {b} ({weight[(a, b)]})" for a, b in cut), file=out)


def print_dot(report: Report, out) -> None:
    in_cycle = {(id(c.level), e) for c in report.cycles for e in c.edges}
    print("digraph modules {", file=out)
    print("  rankdir=LR;", file=out)
    print('  node [shape=box, fontname="monospace"];', file=out)
    for lv in report.levels:
        if lv.parent:
            continue
        cname = lv.crate.name
        print(f'  subgraph "cluster_{cname}" {{', file=out)
        print(f'    label="{cname}";', file=out)
        for n in lv.nodes:
            print(f'    "{cname}::{n}" [label="{n}"];', file=out)
        for (a, b), refs in sorted(lv.edges.items()):
            style = ', color=red, penwidth=2' if (id(lv), (a, b)) in in_cycle else ""
            print(f'    "{cname}::{a}" -> "{cname}::{b}" [label="{len(refs)}"{style}];', file=out)
        print("  }", file=out)
    print("}", file=out)


def run(root_files: list[Path], verbose: bool, dot: bool) -> int:
    report = analyse(root_files)
    for crate in report.crates:
        for w in crate.warnings:
            print(f"warning: {w}", file=sys.stderr)
    text_out = sys.stderr if dot else sys.stdout
    if dot:
        print_dot(report, sys.stdout)
    if report.cycles:
        print_cycles(report, verbose, text_out)
        return 1
    print(
        f"no import cycles: {report.module_count} modules, {report.edge_count} edges checked "
        f"in {len(report.crates)} crate{'s' if len(report.crates) != 1 else ''}",
        file=text_out,
    )
    return 0


# --------------------------------------------------------------------------------------------
# Self-test: synthetic crates with known answers.
# --------------------------------------------------------------------------------------------

SELF_TEST_CYCLIC = {
    "Cargo.toml": '[package]\nname = "cyclic"\nversion = "0.1.0"\n',
    "src/lib.rs": """//! Links in docs do not count: [`crate::c`], [`crate::b::f`].
mod a;
pub mod b;
pub(crate) mod c;
mod d;
mod e;
#[path = "custom/fpath.rs"]
mod f;
#[cfg(test)]
mod testonly;
mod g {
    pub mod deep;
}

pub struct Root;
""",
    # a -> b (code path), a -> c (multi-line nested use tree)
    "src/a.rs": """use crate::{
    c::{self, h as renamed},
    Root,
};

pub fn g<'a>(x: &'a str) -> char {
    let _ = '"'; let _ = '{';
    let _s = "crate::e::nothing";
    let _r = r#"crate::e::"nothing"#;
    /* outer /* nested crate::e */ still comment crate::e */
    crate::b::f();
    renamed();
    c::h();
    'x'
}
""",
    # b -> a through an alias imported with `use`
    "src/b.rs": """use crate::a;
/// See [`crate::e::E`]
pub fn f() {
    let _ = a::g("");
}
""",
    # c references nobody outside tests; the #[cfg(test)] block must be skipped
    "src/c.rs": """pub fn h() {}
#[cfg(test)]
#[allow(unused)]
mod tests {
    use crate::a::g;
    fn t() { crate::b::f(); let _ = '}'; }
}
""",
    # d: mod.rs layout with an inner cycle x <-> y, and parent -> child / child -> parent refs
    "src/d/mod.rs": """mod x;
mod y;
pub struct Thing;
pub fn uses_children() { x::xf(); crate::d::y::yf(); }
""",
    "src/d/x.rs": """use super::Thing;
use super::y::yf;
pub fn xf() -> super::Thing { yf(); Thing }
""",
    "src/d/y.rs": """pub fn yf() { self::inner(); crate::d::x::xf(); }
fn inner() {}
""",
    # e.rs with 2018 child e/inner.rs: inner -> a lifts to e -> a. In the inline module,
    # `super` is e, so `super::super::c` is the root's c (e -> c) and `super::E` is e itself.
    "src/e.rs": """pub mod inner;
pub struct E;
pub mod nested {
    pub fn n() -> super::E { super::super::c::h(); super::inner::i(); super::E }
}
""",
    "src/e/inner.rs": "pub fn i() { crate::a::g(\"\"); }\n",
    "src/custom/fpath.rs": "mod sub;\npub fn k() { sub::s(); }\n",
    "src/custom/sub.rs": "pub fn s() { crate::e::inner::i(); }\n",
    "src/testonly.rs": "use crate::f::k;\n",
    # a file module declared inside an inline module of lib.rs: src/g/deep.rs
    "src/g/deep.rs": "pub fn z() { crate::c::h(); }\n",
}

SELF_TEST_CYCLIC_EXPECT_CYCLES = {((), ("a", "b")), (("d",), ("x", "y"))}
SELF_TEST_CYCLIC_EXPECT_EDGES = {
    (): {("a", "b"), ("a", "c"), ("b", "a"), ("e", "a"), ("e", "c"), ("f", "e"), ("g", "c")},
    ("d",): {("x", "y"), ("y", "x")},
}

SELF_TEST_ACYCLIC = {
    "src/lib.rs": "pub mod p;\npub mod q;\n",
    "src/p.rs": "use crate::q::Q;\npub fn p() -> Q { crate::q::Q }\n",
    "src/q.rs": "/// Not an edge: [`crate::p::p`]\npub struct Q;\nconst S: &str = \"crate::p::p\";\n",
}


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, content in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content, encoding="utf-8")


def self_test() -> int:
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        cyclic, acyclic = Path(tmp) / "cyclic", Path(tmp) / "acyclic"
        write_tree(cyclic, SELF_TEST_CYCLIC)
        write_tree(acyclic, SELF_TEST_ACYCLIC)

        report = analyse([cyclic / "src/lib.rs"])
        got_mods = set(report.crates[0].modules)
        want_mods = {(), ("a",), ("b",), ("c",), ("d",), ("d", "x"), ("d", "y"), ("e",),
                     ("e", "inner"), ("f",), ("f", "sub"), ("g",), ("g", "deep")}
        if got_mods != want_mods:
            failures.append(f"module tree: got {sorted(got_mods)}, want {sorted(want_mods)}")
        if report.crates[0].warnings:
            failures.append(f"unexpected warnings: {report.crates[0].warnings}")
        got_cycles = {(c.level.parent, tuple(c.members)) for c in report.cycles}
        if got_cycles != SELF_TEST_CYCLIC_EXPECT_CYCLES:
            failures.append(f"cycles: got {sorted(got_cycles)}, want {sorted(SELF_TEST_CYCLIC_EXPECT_CYCLES)}")
        got_edges = {lv.parent: set(lv.edges) for lv in report.levels if lv.edges}
        if got_edges != SELF_TEST_CYCLIC_EXPECT_EDGES:
            failures.append(f"edges: got {got_edges}, want {SELF_TEST_CYCLIC_EXPECT_EDGES}")
        root_level = next(lv for lv in report.levels if lv.parent == ())
        a_to_b = root_level.edges.get(("a", "b"), [])
        if [(r.file.name, r.line, r.text) for r in a_to_b] != [("a.rs", 11, "crate::b::f")]:
            failures.append(f"a -> b references: got {[str(r) for r in a_to_b]}")
        b_to_a = root_level.edges.get(("b", "a"), [])
        if [(r.line, r.text) for r in b_to_a] != [(1, "use crate::a"), (4, "a::g")]:
            failures.append(f"b -> a references: got {[str(r) for r in b_to_a]}")

        report = analyse([acyclic / "src/lib.rs"])
        if report.cycles:
            failures.append(f"acyclic crate: unexpected cycles {[c.members for c in report.cycles]}")
        if {lv.parent: set(lv.edges) for lv in report.levels} != {(): {("p", "q")}}:
            failures.append("acyclic crate: expected exactly the edge p -> q")

        # The command line: exit 1 with a cycle, 0 without.
        script = str(Path(__file__).resolve())
        for root, want in ((cyclic, 1), (acyclic, 0)):
            proc = subprocess.run(
                [sys.executable, script, str(root / "src/lib.rs")], capture_output=True, text=True
            )
            if proc.returncode != want:
                failures.append(f"exit status for {root.name}: got {proc.returncode}, want {want}\n{proc.stdout}{proc.stderr}")
        proc = subprocess.run(
            [sys.executable, script, str(cyclic / "src/lib.rs"), str(acyclic / "src/lib.rs")],
            capture_output=True, text=True,
        )
        if proc.returncode != 1 or "a -> b -> a" not in proc.stdout or "x -> y -> x" not in proc.stdout:
            failures.append(f"combined run: unexpected output\n{proc.stdout}{proc.stderr}")

    if failures:
        print("self-test FAILED:", file=sys.stderr)
        for f in failures:
            print("  - " + f, file=sys.stderr)
        return 1
    print("self-test passed")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Find import cycles between sibling modules of Rust crates (stdlib only).",
    )
    ap.add_argument("roots", nargs="*", type=Path,
                    help="crate root files (default: src/lib.rs, ingest/src/lib.rs; store, kernels and fuzz if present)")
    ap.add_argument("--dot", action="store_true",
                    help="print the root-level module graph as Graphviz dot on stdout (report goes to stderr)")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every reference of each cycle edge")
    ap.add_argument("--self-test", action="store_true", help="check the checker on synthetic crates")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    roots = args.roots
    if not roots:
        roots = [REPO_ROOT / r for r in DEFAULT_ROOTS
                 if r not in OPTIONAL_DEFAULT_ROOTS or (REPO_ROOT / r).is_file()]
    missing = [r for r in roots if not r.is_file()]
    if missing:
        print(f"error: no such crate root: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    return run(roots, args.verbose, args.dot)


if __name__ == "__main__":
    sys.exit(main())
