"""Bash's syntax, as much of it as launch scripts use: the lexer (words with their quotes kept, operators, here
documents, `$(...)` / `${...}` / `$((...))` kept whole inside a word, NAME=( ... ) arrays) and the parser (simple
commands with their redirections, pipelines and `&&` / `||` lists, `if` / `while` / `until` / `for` / `case`,
functions, `{ ...; }` and `( ... )` groups). Nothing here expands or runs a word: flows/openrlhf/shell.py reads the
tree as bash would run it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


class ShellError(ValueError):
    """The script is not one bash would run (an unterminated quote ...): the message names the line."""


# ---------------------------------------------------------------------------------------------- lexing
OPS = sorted(["&&", "||", ";;", ";&", ";;&", "|&", "&>>", "&>", ">>", ">&", "<&", "<<<", "<<-", "<<", "<>", ">|",
              ";", "&", "|", "<", ">", "(", ")"], key=len, reverse=True)
REDIRECTS = {"&>>", "&>", ">>", ">&", "<&", "<<<", "<<-", "<<", "<>", ">|", "<", ">"}
RESERVED_END = {"then", "elif", "else", "fi", "do", "done", "esac", "}", "in"}


@dataclass
class Word:
    text: str  # as written, quotes kept
    line: int
    array: list["Word"] | None = None  # NAME=( ... ) / NAME+=( ... ): the elements


@dataclass
class Tok:
    kind: str  # word, op, nl
    value: Any  # Word, the operator, or None
    line: int
    heredoc: tuple[str, bool] | None = None  # an op << / <<-: (body, quoted delimiter)
    delim: Word | None = None  # an op << / <<-: its delimiter word
    target: Word | None = None  # a redirection's target word


def command_start(out: list[Tok]) -> bool:
    """Whether the next word would be a command's first (where `((` opens an arithmetic command)."""
    if not out or out[-1].kind == "nl":
        return True
    last = out[-1]
    if last.kind == "op":
        return last.value in (";", "&&", "||", "|", "&", "(", ";;", "|&")
    return last.value.text in ("for", "while", "until", "if", "elif", "then", "do", "else", "!", "{")


class Lexer:
    def __init__(self, text: str, line: int = 1):
        self.s, self.i, self.base = text, 0, line
        self.pending: list[Tok] = []  # here-document operators waiting for their bodies

    def line(self, i: int | None = None) -> int:
        return self.base + self.s.count("\n", 0, self.i if i is None else i)

    def error(self, what: str, at: int) -> ShellError:
        return ShellError(f"line {self.line(at)}: {what}")

    def tokens(self) -> list[Tok]:
        out: list[Tok] = []
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c in " \t\r":
                self.i += 1
            elif c == "\\" and s.startswith("\\\n", self.i):
                self.i += 2
            elif c == "\\" and self.i + 1 == len(s):  # a backslash ending the file: bash drops it
                self.i += 1
            elif c == "\n":
                out.append(Tok("nl", None, self.line()))
                self.i += 1
                self.heredocs()
            elif c == "#":
                while self.i < len(s) and s[self.i] != "\n":
                    self.i += 1
            elif s.startswith("((", self.i) and command_start(out):
                start = self.i
                self.i = self.paren(self.i) + 1  # (( expr )) as one word
                out.append(Tok("word", Word(s[start:self.i], self.line(start)), self.line(start)))
            elif c.isdigit() and re.match(r"\d+[<>]", s[self.i:]) and (self.i == 0 or s[self.i - 1] in " \t\n;&|"):
                m = re.match(r"\d+", s[self.i:])
                self.i += m.end()  # an fd number: part of the redirection (2>&1)
            elif (op := next((o for o in OPS if s.startswith(o, self.i)), None)) and not (
                    op in ("<", ">") and s.startswith("(", self.i + 1)):
                tok = Tok("op", op, self.line())
                self.i += len(op)
                out.append(tok)
                if op in ("<<", "<<-"):
                    self.pending.append(tok)
            else:
                start = self.i
                text = self.word()
                w = Word(text, self.line(start))
                if re.fullmatch(r"[A-Za-z_]\w*(\[[^]]*\])?\+?=", text) and s.startswith("(", self.i):
                    w.array = self.array()
                out.append(Tok("word", w, w.line))
                if len(out) > 1 and out[-2].kind == "op" and out[-2].value in ("<<", "<<-") and out[-2].delim is None:
                    out[-2].delim = w  # its body is read at the next newline
        self.heredocs()
        return out

    def heredocs(self) -> None:
        s = self.s
        for tok in self.pending:
            if tok.delim is None:
                raise self.error("`<<` without a delimiter", self.i)
            quoted = any(q in tok.delim.text for q in "'\"\\")
            delim = re.sub(r"['\"\\]", "", tok.delim.text)
            body = []
            while self.i < len(s):  # to the delimiter line (bash warns and takes the rest of the file without one)
                end = s.find("\n", self.i)
                end = len(s) if end < 0 else end
                line = s[self.i:end]
                self.i = end + 1
                if (line.lstrip("\t") if tok.value == "<<-" else line) == delim:
                    break
                body.append(line.lstrip("\t") if tok.value == "<<-" else line)
            tok.heredoc = ("\n".join(body) + ("\n" if body else ""), quoted)
        self.pending = []

    def word(self) -> str:
        """One word as written (quotes kept, line continuations removed)."""
        s, out = self.s, []
        while self.i < len(s):
            c = s[self.i]
            if c == "\\":
                if s.startswith("\\\n", self.i):
                    self.i += 2
                    continue
                out.append(s[self.i:self.i + 2])
                self.i += 2
            elif c == "'":
                end = s.find("'", self.i + 1)
                if end < 0:
                    raise self.error("a ' quote that is never closed", self.i)
                out.append(s[self.i:end + 1])
                self.i = end + 1
            elif c == '"':
                end = self.dquote(self.i)
                out.append(s[self.i:end + 1])
                self.i = end + 1
            elif c == "$" and s.startswith("$'", self.i):
                end = self.i + 2
                while end < len(s) and s[end] != "'":
                    end += 2 if s[end] == "\\" else 1
                if end >= len(s):
                    raise self.error("a $' quote that is never closed", self.i)
                out.append(s[self.i:end + 1])
                self.i = end + 1
            elif c == "$" and s.startswith("$(", self.i):
                end = self.paren(self.i + 1)
                out.append(s[self.i:end + 1])
                self.i = end + 1
            elif c == "$" and s.startswith("${", self.i):
                end = self.brace(self.i + 1)
                out.append(s[self.i:end + 1])
                self.i = end + 1
            elif c == "`":
                end = self.i + 1
                while end < len(s) and s[end] != "`":
                    end += 2 if s[end] == "\\" else 1
                if end >= len(s):
                    raise self.error("a ` quote that is never closed", self.i)
                out.append(s[self.i:end + 1])
                self.i = end + 1
            elif c in "<>" and s.startswith("(", self.i + 1) and not out:  # process substitution >(tee log)
                end = self.paren(self.i + 1)
                out.append(s[self.i:end + 1])
                self.i = end + 1
            elif c in " \t\r\n;&|<>()":
                break
            else:
                out.append(c)
                self.i += 1
        return "".join(out)

    def dquote(self, i: int) -> int:
        """The index of the " closing the one at i."""
        s, j = self.s, i + 1
        while j < len(s):
            c = s[j]
            if c == "\\":
                j += 2
            elif c == '"':
                return j
            elif s.startswith("$(", j):
                j = self.paren(j + 1) + 1
            elif s.startswith("${", j):
                j = self.brace(j + 1) + 1
            elif c == "`":
                j += 1
                while j < len(s) and s[j] != "`":
                    j += 2 if s[j] == "\\" else 1
                j += 1
            else:
                j += 1
        raise self.error('a " quote that is never closed', i)

    def paren(self, i: int) -> int:
        """The index of the ) closing the ( at i (quotes and nested parentheses inside)."""
        return self._closing(i, "(", ")", 0, "a ( that is never closed")

    def brace(self, i: int) -> int:
        """The index of the } closing the { of ${ at i (single quotes count only in a nested brace)."""
        return self._closing(i, "{", "}", 1, "a ${ that is never closed")

    def _closing(self, i: int, opening: str, closing: str, quotes_below: int, what: str) -> int:
        s, j, depth = self.s, i, 0
        while j < len(s):
            c = s[j]
            if c == "\\":
                j += 2
                continue
            if c == "'" and depth > quotes_below:
                j = s.find("'", j + 1)
                if j < 0:
                    break
            elif c == '"':
                j = self.dquote(j)
            elif c == opening:
                depth += 1
            elif c == closing:
                depth -= 1
                if depth == 0:
                    return j
            j += 1
        raise self.error(what, i)

    def array(self) -> list[Word]:
        """The elements of NAME=( ... ) (the lexer is at its `(`), newlines and comments inside."""
        s, out = self.s, []
        self.i += 1
        while self.i < len(s):
            c = s[self.i]
            if c in " \t\r\n":
                self.i += 1
            elif s.startswith("\\\n", self.i):
                self.i += 2
            elif c == "#":
                while self.i < len(s) and s[self.i] != "\n":
                    self.i += 1
            elif c == ")":
                self.i += 1
                return out
            else:
                start = self.i
                text = self.word()
                if not text:
                    raise self.error(f"unexpected {c!r} in an array", start)
                out.append(Word(text, self.line(start)))
        raise self.error("an array ( that is never closed", self.i)


# ---------------------------------------------------------------------------------------------- parsing
@dataclass
class Simple:
    words: list[Word]
    redirects: list[Tok]
    line: int
    end: int
    background: bool = False


@dataclass
class If:
    branches: list[tuple[list, list]]  # (condition, body); the else branch's condition is []
    line: int


@dataclass
class LoopNode:
    kind: str  # while, until, for
    head: list  # the condition (while / until), or [Word] (for)
    body: list
    line: int
    header: str


@dataclass
class Case:
    word: Word
    clauses: list[tuple[list[Word], list]]
    line: int


@dataclass
class Function:
    name: str
    body: list


@dataclass
class Group:
    body: list
    line: int


@dataclass
class AndOr:
    parts: list[tuple[str, list]]  # (connector before it: "", "&&", "||"; the pipeline's commands)
    background: bool = False


class Parser:
    def __init__(self, toks: list[Tok], text: str, base: int = 1):
        self.t, self.i, self.lines, self.base = toks, 0, text.splitlines(), base

    def peek(self) -> Tok | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def word_is(self, *values) -> bool:
        t = self.peek()
        return t is not None and t.kind == "word" and t.value.text in values

    def expect(self, value: str) -> None:
        t = self.peek()
        if not (t and ((t.kind == "word" and t.value.text == value) or (t.kind == "op" and t.value == value))):
            line = t.line if t else self.t[-1].line if self.t else 1
            raise ShellError(f"line {line}: `{value}` expected")
        self.i += 1

    def skip_separators(self) -> None:
        while (t := self.peek()) and (t.kind == "nl" or (t.kind == "op" and t.value in (";", "&"))):
            self.i += 1

    def parse_list(self, stops: set[str] = frozenset()) -> list:
        out = []
        while True:
            self.skip_separators()
            t = self.peek()
            if t is None or (t.kind == "word" and t.value.text in stops) or (t.kind == "op" and t.value in stops):
                return out
            node = self.and_or()
            if node is not None:
                out.append(node)

    def and_or(self):
        parts, conn = [], ""
        while True:
            pipeline = [self.command()]
            while (t := self.peek()) and t.kind == "op" and t.value in ("|", "|&"):
                self.i += 1
                while (t := self.peek()) and t.kind == "nl":
                    self.i += 1
                pipeline.append(self.command())
            parts.append((conn, [p for p in pipeline if p is not None]))
            t = self.peek()
            if t and t.kind == "op" and t.value in ("&&", "||"):
                conn = t.value
                self.i += 1
                while (t := self.peek()) and t.kind == "nl":
                    self.i += 1
                continue
            break
        node = AndOr(parts)
        if (t := self.peek()) and t.kind == "op" and t.value == "&":
            node.background = True
            for _, pipeline in parts:
                for p in pipeline:
                    if isinstance(p, Simple):
                        p.background = True
        return node

    def command(self):
        t = self.peek()
        if t is None:
            return None
        if t.kind == "op" and t.value == "(":
            self.i += 1
            body = self.parse_list({")"})
            self.expect(")")
            self.redirections_after()
            return Group(body, t.line)
        if t.kind == "word":
            w = t.value.text
            if w == "if":
                return self.if_()
            if w in ("while", "until"):
                self.i += 1
                head = self.parse_list({"do"})
                self.expect("do")
                body = self.parse_list({"done"})
                self.expect("done")
                self.redirections_after()
                return LoopNode(w, head, body, t.line, self.line_text(t.line))
            if w == "for":
                self.i += 1
                head: list = []
                nxt = self.peek()
                if nxt and nxt.kind == "word" and nxt.value.text.startswith("(("):
                    head = [nxt.value]
                    self.i += 1
                else:
                    name = nxt.value
                    self.i += 1
                    head = [name]
                    if self.word_is("in"):
                        self.i += 1
                        while (n := self.peek()) and n.kind == "word":
                            head.append(n.value)
                            self.i += 1
                self.skip_separators()
                self.expect("do")
                body = self.parse_list({"done"})
                self.expect("done")
                self.redirections_after()
                return LoopNode("for", head, body, t.line, self.line_text(t.line))
            if w == "case":
                return self.case()
            if w == "{":
                self.i += 1
                body = self.parse_list({"}"})
                self.expect("}")
                self.redirections_after()
                return Group(body, t.line)
            if w == "function" or (re.fullmatch(r"[\w.:-]+", w) and self.fn_def_ahead()):
                return self.function()
            if w == "[[":
                return self.test_words()
        return self.simple()

    def fn_def_ahead(self) -> bool:
        t = self.t[self.i + 1:self.i + 3]
        return len(t) == 2 and t[0].kind == "op" and t[0].value == "(" and t[1].kind == "op" and t[1].value == ")"

    def function(self) -> Function:
        if self.word_is("function"):
            self.i += 1
        name = self.peek().value.text
        self.i += 1
        if (t := self.peek()) and t.kind == "op" and t.value == "(":
            self.i += 2
        self.skip_separators()
        body_node = self.command()
        return Function(name, body_node.body if isinstance(body_node, Group) else [body_node])

    def if_(self) -> If:
        first = self.peek()
        branches = []
        self.expect("if")
        while True:
            cond = self.parse_list({"then"})
            self.expect("then")
            body = self.parse_list({"elif", "else", "fi"})
            branches.append((cond, body))
            if self.word_is("elif"):
                self.i += 1
                continue
            if self.word_is("else"):
                self.i += 1
                branches.append(([], self.parse_list({"fi"})))
            self.expect("fi")
            self.redirections_after()
            return If(branches, first.line)

    def case(self) -> Case:
        first = self.peek()
        self.i += 1
        word = self.peek().value
        self.i += 1
        self.skip_separators()
        self.expect("in")
        clauses = []
        while True:
            self.skip_separators()
            if self.word_is("esac"):
                self.i += 1
                break
            if (t := self.peek()) and t.kind == "op" and t.value == "(":
                self.i += 1
            pats = []
            while (t := self.peek()) and not (t.kind == "op" and t.value == ")"):
                if t.kind == "word":
                    pats.append(t.value)
                self.i += 1
            self.expect(")")
            body = self.parse_list({";;", ";&", ";;&", "esac"})
            if (t := self.peek()) and t.kind == "op" and t.value in (";;", ";&", ";;&"):
                self.i += 1
            clauses.append((pats, body))
        return Case(word, clauses, first.line)

    def test_words(self) -> Simple:
        """[[ ... ]]: && || < > inside are the test's, not the shell's."""
        first, words = self.peek(), []
        while (t := self.peek()) is not None:
            self.i += 1
            words.append(t.value if t.kind == "word" else Word(t.value, t.line))
            if t.kind == "word" and t.value.text == "]]":
                break
        return Simple(words, [], first.line, words[-1].line)

    def redirections_after(self) -> None:
        while (t := self.peek()) and t.kind == "op" and t.value in REDIRECTS:
            self.i += 1
            if (n := self.peek()) and n.kind == "word":
                self.i += 1

    def simple(self) -> Simple | None:
        words, redirects, first = [], [], self.peek()
        end = first.line
        while (t := self.peek()) is not None:
            if t.kind == "word":
                if words == [] and t.value.text in RESERVED_END:
                    raise ShellError(f"line {t.line}: unexpected `{t.value.text}`")
                words.append(t.value)
                end = max(end, t.value.line + t.value.text.count("\n"))
                self.i += 1
            elif t.kind == "op" and t.value in REDIRECTS:
                self.i += 1
                target = self.peek()
                if target is not None and target.kind == "word":
                    self.i += 1
                    t.target = target.value
                redirects.append(t)
            else:
                break
        if not words and not redirects:
            t = self.peek()
            raise ShellError(f"line {t.line}: unexpected `{t.value}`")
        return Simple(words, redirects, first.line, end)

    def line_text(self, line: int) -> str:
        k = line - self.base
        return self.lines[k].strip() if 0 <= k < len(self.lines) else ""


def parse(text: str, line: int = 1) -> list:
    toks = Lexer(text, line).tokens()
    return Parser(toks, text, line).parse_list()
