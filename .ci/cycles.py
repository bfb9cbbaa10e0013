#!/usr/bin/env python3
"""No file circle and no module cycle in the crates' sources (issue 28).

Reads the `crate::`, `super::` and `self::` paths (in `use` trees and in code) of every Rust file
of each crate root given, resolves them through the module tree to the file whose module defines
the item (following `use` re-exports, so `super::Violation` re-exported by `sim.rs` from
`oracle.rs` is an edge to `oracle.rs`), and reports:

- a file circle: file A refers to an item of file B and B to an item of A;
- a module cycle: sibling modules (each with all its descendants) that refer to each other,
  directly or through other siblings.

Pure python, no dependencies, about a second: `python3 .ci/cycles.py` checks the library
(`src/lib.rs`), the tools package (`tools/src/lib.rs` and its binaries) and the testkit. Exit
status 1 when it finds any. Comments and string literals are ignored (doc links are not uses),
and so is a facade's `pub use` of its own descendant's item (the users of the item get the edge).

Called from `.ci/run` after the features check: every crate is clean, and stays so.
"""

import glob
import os
import re
import sys

KEYWORDS = {"crate", "super", "self"}


def strip(text):
    """Text with comments, string and char literals blanked (lines kept for messages)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if text[i] == "\n":
                        out.append("\n")
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            out.append(" " + "\n" * text.count("\n", i, j))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(" " + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'":
            m = re.match(r"'(?:\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'\n])'", text[i:])
            if m:
                out.append(" ")
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


TOKEN = re.compile(r"\$?[A-Za-z_][A-Za-z0-9_]*|::|\S")


def tokens(text):
    return TOKEN.findall(strip(text))


class Module:
    def __init__(self, path, file):
        self.path = path  # tuple of names from the crate root
        self.file = file
        self.children = {}  # name -> Module
        self.imports = {}  # name -> absolute path (tuple) it imports
        self.globs = []  # absolute module paths imported with `*`


def parse_use_tree(toks, i, prefix, out):
    """Parses a use tree at toks[i]; appends (segments, alias, glob) to out; returns next index."""
    segs = list(prefix)
    while True:
        t = toks[i]
        if t == "{":
            i += 1
            while toks[i] != "}":
                i = parse_use_tree(toks, i, segs, out)
                if toks[i] == ",":
                    i += 1
            return i + 1
        if t == "*":
            out.append((segs, None, True))
            return i + 1
        if t == "::":
            i += 1
            continue
        segs.append(t)
        i += 1
        if toks[i] == "::":
            continue
        alias = None
        if toks[i] == "as":
            alias = toks[i + 1]
            i += 2
        out.append((segs, alias, False))
        return i


class Crate:
    def __init__(self, root_file):
        self.root_file = root_file
        self.modules = {}  # path -> Module
        self.refs = []  # (from module path, from file, segments, is a `pub use`)
        self.root = self.load(root_file, (), os.path.dirname(root_file))

    def load(self, file, path, child_dir):
        module = Module(path, file)
        self.modules[path] = module
        with open(file, encoding="utf-8") as f:
            toks = tokens(f.read())
        self.walk(toks, module, child_dir)
        return module

    def walk(self, toks, file_module, child_dir):
        stack = [(file_module, child_dir, 0)]  # inline modules: (module, dir for `mod x;`, depth)
        depth = 0
        i, n = 0, len(toks)
        prev = None
        while i < n:
            t = toks[i]
            module, mdir, _ = stack[-1]
            if t == "{":
                depth += 1
            elif t == "}":
                depth -= 1
                if len(stack) > 1 and stack[-1][2] == depth:
                    stack.pop()
            elif t == "mod" and i + 2 < n and re.match(r"[A-Za-z_]", toks[i + 1]) and toks[i + 2] in ";{":
                name = toks[i + 1]
                if toks[i + 2] == ";":
                    base = os.path.join(mdir, name)
                    file = base + ".rs" if os.path.exists(base + ".rs") else os.path.join(base, "mod.rs")
                    if os.path.exists(file):
                        module.children[name] = self.load(file, module.path + (name,), base)
                    i += 3
                    prev = ";"
                    continue
                child = Module(module.path + (name,), file_module.file)
                self.modules[child.path] = child
                module.children[name] = child
                stack.append((child, os.path.join(mdir, name), depth))
                depth += 1
                i += 3
                prev = "{"
                continue
            elif t == "use" and prev in (None, ";", "{", "}", "]", "pub", ")", "crate"):
                trees = []
                j = i + 1
                if toks[j] == "::":
                    j += 1
                j = parse_use_tree(toks, j, [], trees)
                public = prev == "pub" or (prev == ")" and "pub" in toks[max(0, i - 6):i])
                for segs, alias, glob in trees:
                    self.use(module, segs, alias, glob, public)
                i = j
                prev = ";"
                continue
            elif t in KEYWORDS and i + 1 < n and toks[i + 1] == "::" and prev != "::" and not (prev == "in"):
                segs = [t]
                j = i + 1
                while j + 1 < n and toks[j] == "::" and re.match(r"[A-Za-z_]", toks[j + 1]):
                    segs.append(toks[j + 1])
                    j += 2
                self.refs.append((module.path, file_module.file, segs, False))
                i = j
                prev = segs[-1]
                continue
            elif (re.match(r"[A-Za-z_]", t) and prev != "::" and i + 1 < n and toks[i + 1] == "::"
                  and t not in KEYWORDS and not t.startswith("$")):
                # A path from a name in scope: a child module, or a module a `use` brought in.
                segs = [t]
                j = i + 1
                while j + 1 < n and toks[j] == "::" and re.match(r"[A-Za-z_]", toks[j + 1]):
                    segs.append(toks[j + 1])
                    j += 2
                self.refs.append((module.path, file_module.file, ["self"] + segs, False))
                i = j
                prev = segs[-1]
                continue
            prev = t
            i += 1

    def use(self, module, segs, alias, glob, public):
        if segs and segs[-1] == "self":
            segs = segs[:-1]
        if not segs:
            return
        if segs[0] not in KEYWORDS:
            segs = ["self"] + segs  # resolved later: a local name or else an extern crate
        if glob:
            module.globs.append(segs)
        else:
            module.imports[alias or segs[-1]] = segs
        self.refs.append((module.path, module.file, segs, public))

    def absolute(self, from_path, segs):
        """segs with leading crate/super/self turned into an absolute module path, or None."""
        path = list(from_path)
        k = 0
        while k < len(segs) and segs[k] in KEYWORDS:
            if segs[k] == "crate":
                path = []
            elif segs[k] == "super":
                if not path:
                    return None
                path = path[:-1]
            k += 1
        return tuple(path), list(segs[k:])

    def resolve(self, from_path, segs, seen=None):
        """The module path where the item named by segs is defined, or None (extern/unknown)."""
        seen = seen or set()
        key = (from_path, tuple(segs))
        if key in seen:
            return None
        seen.add(key)
        r = self.absolute(from_path, segs)
        if r is None:
            return None
        path, rest = r
        module = self.modules.get(path)
        if module is None:
            return None
        local = segs[0] == "self" and (len(segs) < 2 or segs[1] not in KEYWORDS)
        for idx, name in enumerate(rest):
            if name in module.children:
                module = module.children[name]
                continue
            if name in module.imports:
                target = module.imports[name]
                if target == list(segs):
                    return None
                return self.resolve(module.path, target + rest[idx + 1:], seen)
            if local and module.path == from_path and idx == 0:
                return None  # not a local name: an extern crate or a type's associated item
            return module.path
        return module.path

    def edges(self):
        """(from module path, from file, to module path, to file) for every resolved reference."""
        out = set()
        for from_path, from_file, segs, public in self.refs:
            to = self.resolve(from_path, segs)
            if to is None:
                continue
            if public and to[:len(from_path)] == from_path:
                # A facade's `pub use` of its own descendant's item names it for outsiders; the
                # facade's code does not depend on it (the item's users get an edge to its file).
                continue
            out.add((from_path, from_file, to, self.modules[to].file))
        return out


def sccs(nodes, adj):
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def check(root_file, quiet=False):
    crate = Crate(root_file)
    edges = crate.edges()
    problems = []
    files = {(a, b) for _, a, _, b in edges if a != b}
    for a, b in sorted(files):
        if a < b and (b, a) in files:
            problems.append(f"file circle: {a} <-> {b}")
    # Module cycles: sibling modules, each with its descendants, under their common parent.
    sib = {}
    for src, _, dst, _ in edges:
        k = 0
        while k < len(src) and k < len(dst) and src[k] == dst[k]:
            k += 1
        if k < len(src) and k < len(dst):
            parent = src[:k]
            sib.setdefault(parent, {}).setdefault(src[k], set()).add(dst[k])
    for parent, adj in sorted(sib.items()):
        nodes = set(adj) | {w for ws in adj.values() for w in ws}
        for comp in sccs(nodes, adj):
            where = "::".join(("crate",) + parent)
            problems.append(f"module cycle in {where}: {' -> '.join(comp)}")
    if not quiet:
        print(f"cycles: {root_file}: {len(crate.modules)} modules, {len(files)} file edges, "
              f"{len(problems)} problems")
    return problems


def main(argv):
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    roots = argv[1:] or (
        ["src/lib.rs", "tools/src/lib.rs", "testkit/src/lib.rs"]
        + sorted(glob.glob("tools/src/bin/*.rs") + glob.glob("tools/src/bin/*/main.rs"))
    )
    problems = []
    for root in roots:
        if os.path.exists(root):
            problems += check(root)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
