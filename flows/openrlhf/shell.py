"""The OpenRLHF commands a launch script runs, read as bash reads the script (flows/openrlhf/importer.py turns
them into configs), on the syntax tree of flows/openrlhf/bash_syntax.py. Nothing is run.

Words are bash's: quotes ('...', "...", ANSI-C $'...' with its escapes), backslash escapes and line continuations
(also at the end of the file), comments, redirections (`2>&1 | tee log`, `> >(tee log)`, `&>> log`) and here
documents. Expansions as bash does them, quoting respected: $VAR, ${VAR}, ${VAR:-x} / ${VAR-x} / := / :+ / #
/ % / / / :offset:length / ^^ / ,,, arrays (`A=(...)`, `A+=(...)`, "${A[@]}", ${A[i]}, ${#A[@]}), positional
arguments ($1, $@, $#: the arguments given after `import-openrlhf SCRIPT --`), $((...)) arithmetic (`c ? a : b`,
0x1F, 017, bit operators), brace expansion ({0..7}, {a,b}), and of command substitutions only what needs nothing
to run (`$(echo ...)`, `$(cat <<EOF ...)`, `$(basename X)`, `$(dirname X)`, `$(seq ...)`). Assignments
(`export` / `readonly` / `local` / `declare`, `VAR+=x`, `let`, `printf -v VAR` of %s / %d), `read -r -d '' VAR
<<EOF`, `source FILE ARGS` (FILE from the script's folder), functions (run where they are called), `if` / `case`
whose test is decidable from the script's values, `exit` in a branch that runs, `bash -c "..."` / `eval` (their
text read as a script).

What cannot be known before the script runs stays as written and is named: a variable the script does not set
(`$MASTER_ADDR`) or sets from a command (`$(nvidia-smi ...)`), a test on files (`[ -f X ]`: the commands of
every branch are read, the assignments in them are not taken). Loops are read once, each command tagged with
its loop (`while (( i < N ))`: the iteration count when N is known); after a loop that does not run exactly once,
what its body set is known only when the script runs. tests/flows/test_shell_vs_bash.py checks all this against
bash itself. A line that starts with `--flag` right
after an OpenRLHF command is a missing backslash: bash runs the trainer without those flags and then fails on
them; `...` in a command is a docs fragment's "more flags here".
"""
from __future__ import annotations

import fnmatch
import re
import shlex
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from flows.openrlhf.bash_syntax import (AndOr, Case, Function, Group, If, Lexer, LoopNode, ShellError, Simple, Word,
                                        parse)


# ---------------------------------------------------------------------------------------------- what is found
@dataclass
class Loop:
    line: int
    header: str  # the loop's first line as written
    iterations: int | None  # None: the bound is not a value the script sets


@dataclass
class Command:
    module: str  # train_sft ... ("" for a `source FILE` that could not be read)
    launcher: list[tuple[str, Any]]  # (flag, value) before the module (deepspeed's, torchrun's, ray job submit's)
    flags: list[tuple[str, Any]]  # (flag as written, value: str, list of str, or True for a bare flag)
    line: int
    unresolved: list[str] = field(default_factory=list)  # $VARs / $(...) the script does not set simply
    runner: str = ""  # deepspeed, torchrun, python, ray
    source: str = ""  # the file the command is in, when it is a sourced one
    loop: Loop | None = None
    end: int = 0  # its last line
    env: dict[str, str] = field(default_factory=dict)  # CUDA_VISIBLE_DEVICES as the command sees it
    elided: int = 0  # the line of a `...` (a docs fragment: flags left out)
    by_path: str = ""  # `python openrlhf/cli/train_sft.py`: the path as written
    background: bool = False  # started with `&`
    opaque: list[str] = field(default_factory=list)  # whole words set when the script runs ($EXTRA_ARGS): not read

    @property
    def dialect(self) -> str:
        return "v0.10+ dotted flags" if any("." in f for f, _ in self.flags) else "v0.9 flat flags"


@dataclass
class Server:
    """A reward server the script starts beside the trainer that is not openrlhf.cli.serve_rm (a fork's own)."""
    line: int
    text: str
    source: str = ""


@dataclass
class Script:
    commands: list[Command]  # OpenRLHF commands, serve_rm included, in order
    servers: list[Server]
    orphans: list[tuple[int, int, str, Command]]  # (first line, last line, text, the command before them)
    unread: list[str]  # `source FILE` lines whose FILE is not beside the script
    undecided: list[tuple[int, str]]  # (line, test) of branches read without knowing which runs
    positional: list[str]  # $N the script reads that no argument gave
    exit_line: int = 0  # an `exit` that runs before the end


# ---------------------------------------------------------------------------------------------- expanding
class Unknown(str):
    """A value set when the script runs (from a command): expands to `$NAME` as written, named as unresolved."""


ANSI = {"a": "\a", "b": "\b", "e": "\x1b", "E": "\x1b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
        "\\": "\\", "'": "'", '"': '"', "?": "?"}


def ansi_c(body: str) -> str:
    """The text of $'...' (bash's escapes)."""
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\" or i + 1 >= len(body):
            out.append(c)
            i += 1
            continue
        n = body[i + 1]
        if n in ANSI:
            out.append(ANSI[n])
            i += 2
        elif n == "x" and (m := re.match(r"[0-9a-fA-F]{1,2}", body[i + 2:])):
            out.append(chr(int(m.group(0), 16)))
            i += 2 + m.end()
        elif n in "uU" and (m := re.match(r"[0-9a-fA-F]{1,8}" if n == "U" else r"[0-9a-fA-F]{1,4}", body[i + 2:])):
            out.append(chr(int(m.group(0), 16)))
            i += 2 + m.end()
        elif (m := re.match(r"[0-7]{1,3}", body[i + 1:])):
            out.append(chr(int(m.group(0), 8)))
            i += 1 + m.end()
        elif n == "c" and i + 2 < len(body):
            out.append(chr(ord(body[i + 2]) & 0x1F))
            i += 3
        else:
            out.append(c + n)
            i += 2
    return "".join(out)


class Fields:
    """Bash's field building: literal text joins the current field, unquoted expansions are split."""

    def __init__(self):
        self.out: list[str] = []
        self.cur: str | None = None

    def lit(self, text: str) -> None:
        self.cur = (self.cur or "") + text

    def split(self, value: str) -> None:
        if not value:
            return
        parts = value.split()
        if not parts:
            self.end()
            return
        if value[0].isspace():
            self.end()
        for k, part in enumerate(parts):
            if k:
                self.end()
            self.lit(part)
        if value[-1].isspace():
            self.end()

    def end(self) -> None:
        if self.cur is not None:
            self.out.append(self.cur)
        self.cur = None

    def done(self) -> list[str]:
        self.end()
        return self.out


# ---------------------------------------------------------------------------------------------- the reader
LAUNCH_MODULE = re.compile(r"^openrlhf\.cli\.(\w+)$")
LAUNCH_PATH = re.compile(r"(?:^|/)openrlhf/cli/(\w+)\.py$")
SERVER = re.compile(r"(remote_rm|reward_server|rm_server|serve_rm|reward_api)", re.I)
WRAPPERS = {"nohup", "time", "exec", "stdbuf", "setsid", "unbuffer", "sudo", "command", "builtin"}


class Exit(Exception):
    pass


class Reader:
    def __init__(self, folder: Path | None, args: list[str] | None = None, script: str = "script"):
        self.folder = folder
        self.env: dict[str, Any] = {}
        self.exported: set[str] = set()
        self.args: list[str] = list(args or [])
        self.given = len(self.args)
        self.script = script
        self.functions: dict[str, list] = {}
        self.found: list[Command] = []
        self.servers: list[Server] = []
        self.orphans: list = []
        self.unread: list[str] = []
        self.undecided: list[tuple[int, str]] = []
        self.positional: list[str] = []
        self.unresolved: list[str] = []  # collected while expanding one command
        self.kept: set[str] = set()  # every expansion kept as written (values may carry them into commands)
        self.own_args = True  # $N are the script's own arguments (not a function's or a sourced file's)
        self.source = ""
        self.loop: Loop | None = None
        self.maybe = 0  # inside branches whose test is undecided
        self.skipped = 0  # assignments not taken there
        self.line = 0  # of the command being read
        self.exit_line = 0
        self.depth = 0
        self.text = ""

    # ------------------------------------------------------------------ running nodes
    def read(self, text: str, source: str = "", line: int = 1) -> None:
        saved_source, saved_text = self.source, self.text
        self.source, self.text = source, text
        try:
            self.run(parse(text, line))
        finally:
            self.source, self.text = saved_source, saved_text

    def run(self, nodes: list) -> None:
        last: Command | None = None
        for node in nodes:
            if isinstance(node, AndOr):
                last = self.and_or(node, last)
            else:
                self.node(node)
                last = None

    def node(self, node) -> bool | None:
        """Runs a node; its exit status when known (True: success)."""
        if isinstance(node, Simple):
            return self.simple(node)
        if isinstance(node, AndOr):
            self.and_or(node, None)
            return None
        if isinstance(node, Group):
            self.run(node.body)
            return None
        if isinstance(node, Function):
            self.functions[node.name] = node.body
            return True
        if isinstance(node, If):
            return self.if_(node)
        if isinstance(node, LoopNode):
            return self.loop_(node)
        if isinstance(node, Case):
            return self.case(node)
        return None

    def and_or(self, node: AndOr, last: Command | None) -> Command | None:
        """Runs `a && b || c | d`; returns the OpenRLHF command it ends with (or `last` after a --flag line that
        continues it), for the next line's missing-backslash check."""
        status: bool | None = True
        found_before = len(self.found)
        for k, (conn, pipeline) in enumerate(node.parts):
            if (conn == "&&" and status is False) or (conn == "||" and status is True):
                continue
            first = pipeline[0] if pipeline else None
            if k == 0 and isinstance(first, Simple) and last is not None and self.orphan(first, last):
                return last
            if conn and status is None:  # after a command whose outcome the script's run decides
                before = node.parts[k - 1][1]
                test = " ".join(w.text for w in before[0].words) if before and isinstance(before[0], Simple) else "..."
                with self.undecided_branch(first.line if isinstance(first, Simple) else 0, f"{test} {conn}"):
                    status = self.pipeline(pipeline)
            else:
                status = self.pipeline(pipeline)
        new = self.found[found_before:]
        for c in new:
            c.background = c.background or node.background
        return new[-1] if new and new[-1].module else None

    def pipeline(self, nodes: list) -> bool | None:
        status = self.node(nodes[0]) if nodes else None
        for rest in nodes[1:]:
            self.node(rest)
        return status

    def orphan(self, node: Simple, last: Command) -> bool:
        """A command starting with --flag right after an OpenRLHF command: the line before it lacks its backslash
        (bash runs the trainer without these flags, then fails on them); a `...` line: a docs fragment's rest."""
        words = [w.text for w in node.words]
        if words and words[0] == "...":
            last.elided = last.elided or node.line
            return True
        if words and words[0].startswith("--"):
            self.orphans.append((node.line, node.end, " ".join(words), last))
            return True
        return False

    def if_(self, node: If) -> bool | None:
        for k, (cond, body) in enumerate(node.branches):
            if not cond:  # else
                self.run(body)
                return None
            verdict = self.test(cond)
            if verdict is True:
                self.run(body)
                return None
            if verdict is None:  # this branch or a later one runs: each is read, none of their assignments taken
                with self.undecided_branch(node.line, self.cond_text(cond)):
                    for _, rest in node.branches[k:]:
                        self.run(rest)
                return None
        return None

    @contextmanager
    def undecided_branch(self, line: int, test: str):
        """Reading a branch that may not run; named when it held a command or an assignment."""
        found, skipped = len(self.found), self.skipped
        self.maybe += 1
        try:
            yield
        finally:
            self.maybe -= 1
        if (len(self.found) > found or self.skipped > skipped) and (line, test) not in self.undecided:
            self.undecided.append((line, test))

    def cond_text(self, cond: list) -> str:
        words = []
        for n in cond:
            if isinstance(n, AndOr):
                for conn, pipeline in n.parts:
                    words += [conn] if conn else []
                    for p in pipeline:
                        words += [w.text for w in p.words] if isinstance(p, Simple) else ["..."]
        return " ".join(words)

    def test(self, cond: list) -> bool | None:
        """A condition list's verdict when decidable: the last command's status."""
        verdict: bool | None = None
        for n in cond:
            if isinstance(n, AndOr):
                verdict = True
                for conn, pipeline in n.parts:
                    if (conn == "&&" and verdict is False) or (conn == "||" and verdict is True):
                        continue
                    if conn and verdict is None:
                        return None
                    cmd = pipeline[-1] if pipeline else None
                    if not isinstance(cmd, Simple):
                        return None
                    verdict = self.test_command(cmd)
                    if len(pipeline) > 1 and cmd.words and cmd.words[0].text == "!":
                        verdict = None if verdict is None else not verdict
            else:
                return None
        return verdict

    def test_command(self, node: Simple) -> bool | None:
        words = node.words
        negate = False
        if words and words[0].text == "!":
            negate, words = True, words[1:]
        if not words:
            return None
        head = words[0].text
        if head.startswith("((") and head.endswith("))"):
            v = self.arith(head[2:-2])
            result = None if v is None else v != 0
        elif head in ("[[", "[", "test"):
            args = words[1:-1] if head in ("[[", "[") else words[1:]
            if head == "[[" and any(w.text == "=~" for w in args):  # the regex is the rest of the test, ( ) included
                k = next(i for i, w in enumerate(args) if w.text == "=~") + 1
                end = next((i for i in range(k, len(args)) if args[i].text in ("&&", "||")), len(args))
                if end > k:
                    args = [*args[:k], Word("".join(w.text for w in args[k:end]), args[k].line), *args[end:]]
            vals: list[str | None] = []
            for w in args:
                if w.text in ("&&", "||", "!", "(", ")", "<", ">", "-a", "-o"):
                    vals.append(w.text)
                    continue
                before = len(self.unresolved)
                got = (self.expand_word(w, split=False) or [""])[0]
                vals.append(None if len(self.unresolved) > before or self.opaque(got) else got)
            self.unresolved = []
            result = test_expr(vals, head == "[[")
        elif head in ("true", ":"):
            result = True
        elif head == "false":
            result = False
        else:
            self.simple(node)
            return None
        return None if result is None else result != negate

    def loop_(self, node: LoopNode) -> None:
        header = node.header
        iterations = None
        before = dict(self.env)  # what the loop changes (its variable and body) is set aside after it
        c_style = node.kind == "for" and node.head and isinstance(node.head[0], Word) and \
            node.head[0].text.startswith("((")
        if c_style:
            init, cond, _ = (node.head[0].text[2:-2].split(";") + ["", "", ""])[:3]
            self.arith(init)
            iterations = loop_count(f"(( {cond} ))", self)
        elif node.kind == "for":
            items = [f for w in node.head[1:] for f in self.expand_word(w)]
            self.unresolved = []
            iterations = len(items) if node.head[1:] else len(self.args)
            if not node.head[1:]:
                items = list(self.args)
            self.assign(node.head[0].text, items[0] if items else "")
        else:
            cond_text = self.cond_text(node.head)
            iterations = loop_count(cond_text, self)
            if node.kind == "until" and iterations is not None:
                iterations = None
        loop = Loop(node.line, header, iterations)
        saved, self.loop = self.loop, self.loop or loop
        try:
            self.run(node.body)
        finally:
            self.loop = saved
        if iterations != 1 or c_style:  # read once: after the loop, what it set is the last iteration's (or, with
            # no iteration, what it was; a (( ;; )) loop's update is not read), known only when the script runs
            for name, value in list(self.env.items()):
                if before.get(name) is not value and not self.maybe:
                    self.env[name] = Unknown(name)

    def case(self, node: Case) -> None:
        value = (self.expand_word(node.word, split=False) or [""])[0]
        known = not self.unresolved and not self.opaque(value)
        self.unresolved = []
        for pats, body in node.clauses:
            texts = [p.text for p in pats if p.text != "|"]
            if known:
                if any(fnmatch.fnmatchcase(value, (self.expand_word(p, split=False) or [""])[0]) for p in
                       [Word(t, node.line) for t in texts]):
                    self.run(body)
                    return
            else:
                with self.undecided_branch(node.line, f"case {node.word.text}"):
                    self.run(body)

    # ------------------------------------------------------------------ simple commands
    def simple(self, node: Simple) -> bool | None:
        self.unresolved, self.line = [], node.line
        words = list(node.words)
        if not words:
            return True
        if words[0].text in ("[[", "[", "test") or words[0].text.startswith("(("):
            if words[0].text.startswith("((") and re.search(r"[^=!<>]=[^=]|\+\+|--", words[0].text):
                self.arith(words[0].text[2:-2])  # ((i++)), ((i = i + 1))
                return True
            return self.test_command(node)
        # leading assignments: alone they set variables, before a command they are its environment
        env: dict[str, str] = {}
        k = 0
        while k < len(words) and (m := re.match(r"^([A-Za-z_]\w*)(\[[^]]*\])?(\+?)=", words[k].text)):
            if words[k].array is not None:
                self.assign_array(m.group(1), words[k].array, append=bool(m.group(3)))
            elif m.group(2) and k + 1 == len(words):  # A[i]=x: one element
                self.assign_element(m.group(1), m.group(2)[1:-1], self.rhs(m.group(1), words[k].text[m.end():],
                                                                            words[k].line))
            else:
                env[m.group(1) + m.group(3)] = self.rhs(m.group(1), words[k].text[m.end():], words[k].line)
            k += 1
        if k == len(words):
            for name, value in env.items():
                self.assign(name.rstrip("+"), value, append=name.endswith("+"))
            return True
        words = words[k:]
        head = words[0].text
        if head in ("export", "readonly", "local", "declare", "typeset"):
            for w in words[1:]:
                if w.text.startswith("-"):
                    continue
                m = re.match(r"^([A-Za-z_]\w*)(\+?)=", w.text)
                if m and w.array is not None:
                    self.assign_array(m.group(1), w.array, append=bool(m.group(2)))
                elif m:
                    self.assign(m.group(1), self.rhs(m.group(1), w.text[m.end():], w.line), append=bool(m.group(2)))
                if head == "export":
                    self.exported.add((m.group(1) if m else w.text))
            self.unresolved = []
            return True
        if head == "read":
            return self.read_builtin(words, node, env.get("IFS", self.env.get("IFS")))
        fields = self.expand_words(words)
        if not fields:
            return True
        unresolved = sorted(set(self.unresolved))
        self.unresolved = []
        return self.command(fields, node, env, unresolved)

    def command(self, w: list[str], node: Simple, env: dict[str, str], unresolved: list[str]) -> bool | None:
        while w and (w[0] in WRAPPERS or w[0] == "env" or re.match(r"^[A-Za-z_]\w*=", w[0])):
            if w[0] == "env" or re.match(r"^[A-Za-z_]\w*=", w[0]):
                if "=" in w[0]:
                    name, _, value = w[0].partition("=")
                    env[name] = value
                w = w[1:]
                continue
            w = w[1:]
            while w and w[0].startswith("-") and not w[0].startswith("--"):  # stdbuf -oL, sudo -E
                w = w[1:]
        if not w:
            return True
        head = w[0]
        if head in ("source", ".") and len(w) > 1:
            self.source_file(w[1], w[2:], node.line)
            return True
        if head == "exit":
            if not self.maybe:
                self.exit_line = node.line
                raise Exit()
            return None
        if head == "shift":
            n = int(w[1]) if len(w) > 1 and w[1].isdigit() else 1
            if not self.maybe:
                self.args = self.args[n:]
            return True
        if head == "set" and len(w) > 1 and w[1] == "--":
            if not self.maybe:
                self.args = w[2:]
            return True
        if head == "let" and len(w) > 1:  # let EXPR...: its status is the last one's
            results = [self.arith(e) for e in w[1:]]
            return None if None in results else results[-1] != 0
        if head == "printf" and len(w) > 3 and w[1] == "-v" and re.fullmatch(r"[A-Za-z_]\w*", w[2]):
            out = printf(w[3], w[4:])
            self.assign(w[2], Unknown(w[2]) if out is None or any(k in x for x in w for k in self.kept) else out)
            return True
        if head in ("cd", "echo", "printf", "sleep", "mkdir", "true", ":"):
            return True
        if head == "false":
            return False
        if head == "unset":
            for name in w[1:]:
                if not self.maybe:
                    self.env.pop(name, None)
            return True
        if head in self.functions and self.depth < 20:
            saved = self.args, self.own_args
            self.args, self.own_args, self.depth = w[1:], False, self.depth + 1
            try:
                self.run(self.functions[head])
            finally:
                (self.args, self.own_args), self.depth = saved, self.depth - 1
            return None
        if head == "eval":
            self.read(" ".join(w[1:]), self.source, node.line)
            return None
        at, module, by_path = launch_point(w)
        if at is None:
            # `bash -c "..."` (under srun, ssh ...), `sh -c`: the text is a script
            for k, x in enumerate(w):
                if k and w[k - 1] == "-c" and ("openrlhf" in x or SERVER.search(x)):
                    self.read(x, self.source, node.line)
                    return None
            if any(SERVER.search(x) for x in w[:3]) or (len(w) > 2 and w[1] == "-m" and SERVER.search(w[2])):
                self.servers.append(Server(node.line, shlex.join(w), self.source))
            return None
        launcher = w[:at - (0 if by_path else 1)]
        args = w[at + 1:]
        elided = next((word.line for word in node.words if word.text == "..."), node.line) if "..." in args else 0
        args = [a for a in args if a != "..."]
        # a whole word the running script sets, not a flag's value ($EXTRA_ARGS): flags unknown here
        loose = {k for k, a in enumerate(args) if a in self.kept and (k == 0 or not args[k - 1].startswith("--"))}
        opaque, args = [args[k] for k in sorted(loose)], [a for k, a in enumerate(args) if k not in loose]
        runner = Path(launcher[0]).name if launcher else "python"
        runner = "python" if runner.startswith("python") else runner
        cuda = env.get("CUDA_VISIBLE_DEVICES")
        if cuda is None and "CUDA_VISIBLE_DEVICES" in self.exported:  # only an exported variable reaches the launcher
            cuda = self.env.get("CUDA_VISIBLE_DEVICES")
        unresolved = sorted(set(unresolved) | {k for k in self.kept if any(k in x for x in w)})
        cmd = Command(module, launcher_flags(launcher[1:]), flag_values(args), node.line, unresolved, runner,
                      self.source, self.loop, node.end,
                      {"CUDA_VISIBLE_DEVICES": cuda} if isinstance(cuda, str) and not isinstance(cuda, Unknown) else {},
                      elided, by_path, node.background, opaque)
        self.found.append(cmd)
        return None

    def read_builtin(self, words: list[Word], node: Simple, ifs: Any = None) -> bool:
        """read [-r] [-d ''] VAR... <<EOF / <<< word: the variables get the here-document's text (split on IFS's
        whitespace; an IFS of other characters: not read here)."""
        opts, names, k = set(), [], 1
        while k < len(words):
            t = words[k].text
            if t == "-d" and k + 1 < len(words):
                opts.add("d")
                k += 2
                continue
            if t.startswith("-"):
                opts |= set(t[1:])
                k += 1
                continue
            names.append(t)
            k += 1
        body = None
        for r in node.redirects:
            if r.value in ("<<", "<<-") and r.heredoc is not None:
                text, quoted = r.heredoc
                body = text if quoted else self.expand_heredoc(text)
            elif r.value == "<<<" and getattr(r, "target", None) is not None:
                got = self.expand_word(r.target, split=False)
                body = (got[0] if got else "") + "\n"
        if body is None or not names or (ifs is not None and (not isinstance(ifs, str) or ifs.strip())):
            for n in names:
                self.assign(n, Unknown(n))
            return True
        if "d" not in opts:
            body = body.split("\n", 1)[0]
        if "r" not in opts:
            body = re.sub(r"\\(.)", r"\1", body.replace("\\\n", ""))
        parts = body.split(None, len(names) - 1) if len(names) > 1 else [body.strip()]
        for n, v in zip(names, parts + [""] * len(names)):
            self.assign(n, v.strip() if len(names) > 1 else v)
        self.unresolved = []
        return True

    def source_file(self, name: str, args: list[str], line: int) -> None:
        path = Path(name)
        if not path.is_absolute() and self.folder is not None:
            path = self.folder / name
        if "$" in name or not path.is_file():
            self.unread.append(f"source {name}")
            return
        saved = self.args, self.own_args
        if args:
            self.args, self.own_args = list(args), False
        try:
            self.read(path.read_text(), source=name)
        finally:
            self.args, self.own_args = saved

    # ------------------------------------------------------------------ variables
    def rhs(self, name: str, text: str, line: int) -> str:
        """An assignment's value: expanded, not split; Unknown when it comes from a command that must run."""
        before = len(self.unresolved)
        value = self.expand_word(Word(text, line), split=False)
        if any(u.startswith(("$(", "`")) for u in self.unresolved[before:]):
            return Unknown(name)
        return value[0] if value else ""

    def assign(self, name: str, value: Any, append: bool = False) -> None:
        if self.maybe:  # a branch that may not run: the value before it stays
            self.skipped += 1
            return
        if append:
            old = self.env.get(name)
            if isinstance(old, list):
                self.env[name] = old + [value] if isinstance(value, str) else old + list(value)
                return
            value = (old or "") + value if not isinstance(old, Unknown) else old
        self.env[name] = value

    def assign_array(self, name: str, elements: list[Word], append: bool = False) -> None:
        values = [f for w in elements for f in self.expand_word(w)]
        if self.maybe:
            self.skipped += 1
            return
        old = self.env.get(name)
        if append:
            base = old if isinstance(old, list) else ([old] if isinstance(old, str) and old else [])
            self.env[name] = base + values
        else:
            self.env[name] = values

    def opaque(self, value: str) -> bool:
        """Whether a value holds an expansion kept as written (known only when the script runs)."""
        return any(k in value for k in self.kept)

    def assign_element(self, name: str, index: str, value: str) -> None:
        old, k = self.env.get(name), self.arith(index)
        if self.maybe or k is None or k < 0:
            self.skipped += 1
            return
        items = list(old) if isinstance(old, list) else [old] if isinstance(old, str) else []
        items += [""] * (k + 1 - len(items))
        items[k] = value
        self.env[name] = items

    def value(self, name: str) -> Any:
        """A variable's value: str, list (an array), Unknown, or None (not set by the script)."""
        if name.isdigit():
            k = int(name)
            if k == 0:
                return self.script
            if k <= len(self.args):
                return self.args[k - 1]
            if self.own_args and f"${k}" not in self.positional:
                self.positional.append(f"${k}")
            return ""
        if name == "#":
            return str(len(self.args))
        if name in ("@", "*"):
            return list(self.args)
        if name in ("?", "$", "!", "-"):
            return Unknown(name)
        return self.env.get(name)

    # ------------------------------------------------------------------ expansion
    def expand_words(self, words: list[Word]) -> list[str]:
        out = []
        for w in words:
            if w.array is not None:  # cmd A=(x y): an array assignment as an argument (declare -a)
                out.append(w.text + "(" + " ".join(x.text for x in w.array) + ")")
                continue
            out += self.expand_word(w)
        return out

    def expand_word(self, w: Word, split: bool = True) -> list[str]:
        """The fields of one word (unquoted expansions split on whitespace when `split`; a command's words, a loop's
        items and an array's elements are brace-expanded first, as bash does, an assignment's value is not)."""
        out = []
        for text in (brace_expand(w.text) if split else [w.text]):
            f = Fields()
            self._expand(text, f, quoted=False, split=split)
            out += f.done()
        return out

    def expand_text(self, text: str) -> str:
        """A word inside ${VAR:-word}: expanded, quotes removed, not split."""
        f = Fields()
        self._expand(text, f, quoted=False, split=False)
        return "".join(f.done())

    def expand_heredoc(self, text: str) -> str:
        """An unquoted here-document's body: $-expansions and \\$ \\` \\\\ \\<newline>; quotes are literal."""
        out, i = [], 0
        while i < len(text):
            c = text[i]
            if c == "\\" and i + 1 < len(text) and text[i + 1] in "$`\\\n":
                out.append("" if text[i + 1] == "\n" else text[i + 1])
                i += 2
            elif c == "$" or c == "`":
                j = self.dollar_end(text, i)
                f = Fields()
                self.dollar(text[i:j], f, quoted=True, split=False)
                out.append("".join(f.done()))
                i = j
            else:
                out.append(c)
                i += 1
        return "".join(out)

    def _expand(self, s: str, f: Fields, quoted: bool, split: bool) -> None:
        i = 0
        while i < len(s):
            c = s[i]
            if c == "\\":
                if quoted:
                    nxt = s[i + 1:i + 2]
                    if nxt in ('$', '`', '"', '\\'):
                        f.lit(nxt)
                        i += 2
                    elif nxt == "\n":
                        i += 2
                    else:
                        f.lit("\\")
                        i += 1
                else:
                    f.lit(s[i + 1:i + 2])
                    i += 2
            elif c == "'" and not quoted:
                end = s.index("'", i + 1)
                f.lit(s[i + 1:end])
                i = end + 1
            elif c == '"' and not quoted:
                end = Lexer(s).dquote(i)
                inner = s[i + 1:end]
                if not re.fullmatch(r"\$@|\$\{@\}|\$\{[A-Za-z_]\w*\[@\]\}", inner):
                    f.lit("")  # "" is a field even when empty ("$@" of nothing is none)
                self._expand(inner, f, quoted=True, split=split)
                i = end + 1
            elif c == "$" and s.startswith("$'", i) and not quoted:
                end = i + 2
                while end < len(s) and s[end] != "'":
                    end += 2 if s[end] == "\\" else 1
                f.lit(ansi_c(s[i + 2:end]))
                i = end + 1
            elif c == "$" or c == "`":
                j = self.dollar_end(s, i)
                if j == i + 1 and c == "$":
                    f.lit("$")
                    i += 1
                    continue
                self.dollar(s[i:j], f, quoted, split)
                i = j
            elif c == "~" and not quoted and (i == 0 or s[i - 1] in "=:") and (i + 1 == len(s) or s[i + 1] == "/"):
                home = self.env.get("HOME")
                if isinstance(home, str):
                    f.lit(home)
                else:
                    f.lit("~")
                i += 1
            else:
                f.lit(c)
                i += 1

    @staticmethod
    def dollar_end(s: str, i: int) -> int:
        if s[i] == "`":
            j = i + 1
            while j < len(s) and s[j] != "`":
                j += 2 if s[j] == "\\" else 1
            return j + 1
        if s.startswith("$((", i) or s.startswith("$(", i):
            return Lexer(s).paren(i + 1) + 1
        if s.startswith("${", i):
            return Lexer(s).brace(i + 1) + 1
        m = re.match(r"\$([A-Za-z_]\w*|[0-9]|[#@*?$!-])", s[i:])
        return i + m.end() if m else i + 1

    def dollar(self, text: str, f: Fields, quoted: bool, split: bool) -> None:
        """One $-expansion into the fields."""
        def put(value) -> None:
            if isinstance(value, Unknown):
                keep()
            elif isinstance(value, list):
                if text.endswith("[*]}") or text == "$*" or not split:  # one word: the elements joined
                    put(" ".join(value))
                    return
                for k, v in enumerate(value):
                    if k:
                        f.end()
                    f.lit(v) if quoted else f.split(v)
            elif quoted or not split:
                f.lit(value)
            else:
                f.split(value)

        def keep() -> None:  # left as written: named as unresolved wherever it ends up
            f.lit(text)
            self.unresolved.append(text)
            self.kept.add(text)

        if text.startswith("$((") and text.endswith("))"):
            v = self.arith(text[3:-2])
            keep() if v is None else f.lit(str(v))
            return
        if text.startswith("$(") or text.startswith("`"):
            inner = text[2:-1] if text.startswith("$(") else text[1:-1]
            put(self.substitution(inner, text))
            return
        if text.startswith("${"):
            put(self.parameter(text[2:-1], text))
            return
        v = self.value(text[1:])
        keep() if v is None else put(v)  # a variable the script does not set: the environment may

    def substitution(self, inner: str, text: str) -> Any:
        """$(...) whose output needs nothing to run; Unknown otherwise."""
        s = inner.strip()
        m = re.match(r"^cat\s*<<-?\s*['\"]?(\w+)['\"]?\s*\n(.*?)\n\s*\1\s*$", s, re.S)
        if m:
            quoted = bool(re.match(r"^cat\s*<<-?\s*['\"]", s))
            return m.group(2) if quoted else self.expand_heredoc(m.group(2) + "\n").rstrip("\n")
        try:
            toks = parse(s)
        except ShellError:
            return Unknown(text)
        if len(toks) != 1 or not isinstance(toks[0], AndOr) or len(toks[0].parts) != 1 or len(toks[0].parts[0][1]) != 1:
            return Unknown(text)
        node = toks[0].parts[0][1][0]
        if not isinstance(node, Simple) or node.redirects:
            return Unknown(text)
        before = len(self.unresolved)
        w = self.expand_words(node.words)
        if len(self.unresolved) > before or not w:
            del self.unresolved[before:]
            return Unknown(text)
        if w[0] == "echo":
            args = w[1:]
            if args and args[0] == "-n":
                args = args[1:]
            return " ".join(args)
        if w[0] == "basename" and len(w) in (2, 3):
            base = PurePosixPath(w[1]).name
            return base[:-len(w[2])] if len(w) == 3 and base.endswith(w[2]) else base
        if w[0] == "dirname" and len(w) == 2:
            return str(PurePosixPath(w[1]).parent)
        if w[0] == "seq" and 2 <= len(w) <= 4 and all(re.fullmatch(r"-?\d+", x) for x in w[1:]):  # [FIRST [STEP]] LAST
            first, step, last = (1, 1, int(w[1])) if len(w) == 2 else (int(w[1]), 1, int(w[2])) if len(w) == 3 else \
                (int(w[1]), int(w[2]), int(w[3]))
            return "\n".join(map(str, range(first, last + (1 if step > 0 else -1), step))) if step else Unknown(text)
        return Unknown(text)

    def parameter(self, body: str, text: str) -> Any:
        """${...}: bash's parameter expansions."""
        if body.startswith("#") and len(body) > 1:  # ${#VAR}, ${#A[@]}
            m = re.fullmatch(r"#([A-Za-z_]\w*|[0-9]+|[@*])(\[[@*]\])?", body)
            if m:
                v = self.value(m.group(1))
                if v is None or isinstance(v, Unknown):
                    return Unknown(text)
                return str(len(v)) if isinstance(v, list) and (m.group(2) or m.group(1) in "@*") else \
                    str(len(v if isinstance(v, str) else (v[0] if v else "")))
        m = re.match(r"^([A-Za-z_]\w*|[0-9]+|[@*#?$!])(\[([^]]*)\])?", body)
        if not m:
            return Unknown(text)
        name, index, rest = m.group(1), m.group(3), body[m.end():]
        v = self.value(name)
        if index is not None and isinstance(v, list) and index not in ("@", "*"):
            k = self.arith(index)
            v = Unknown(text) if k is None else v[k] if -len(v) <= k < len(v) else ""
        elif index is not None and index not in ("@", "*", "0") and isinstance(v, str):
            v = ""
        elif isinstance(v, list) and index is None and name not in ("@", "*"):  # ${A}: the first element
            v = v[0] if v else ""
        if not rest:
            return v if v is not None else Unknown(text) if name not in ("@", "*") else []
        if isinstance(v, Unknown):
            return v
        if rest in ("^^", "^", ",,", ","):  # ${V^^} / ${V,,}: upper / lower case, ${V^} / ${V,}: the first letter
            if v is None:
                return Unknown(text)
            return [change_case(s, rest) for s in v] if isinstance(v, list) else change_case(v, rest)
        if (sub := re.fullmatch(r":([^:]*)(?::(.*))?", rest)) and not re.match(r":[-=+?]", rest):
            return self.substring(v, name, sub.group(1), sub.group(2), text)
        op = re.match(r"^(:-|-|:=|=|:\+|\+|:\?|\?|##|#|%%|%|//|/)", rest)
        if not op:  # ${V@Q}, ${!V}, a case pattern ...: not read here
            return Unknown(text)
        op, arg = op.group(1), rest[op.end():]
        unset, empty = v is None, v is None or v == "" or v == []
        if op in (":-", "-", ":=", "=", ":?", "?"):
            use_default = empty if op.startswith(":") else unset
            if not use_default:
                return v
            if op in (":?", "?"):  # bash prints the message and exits
                if self.maybe:
                    return Unknown(text)
                self.exit_line = self.line
                raise Exit()
            d = self.expand_text(arg)
            if op in (":=", "="):
                self.assign(name, d)
            return d
        if op in (":+", "+"):
            return "" if (empty if op == ":+" else unset) else self.expand_text(arg)
        if v is None:
            return Unknown(text)
        values = v if isinstance(v, list) else [v]
        pat = self.expand_text(arg) if op not in ("/", "//") else None
        out = []
        for s in values:
            if op in ("#", "##"):
                cut = [k for k in range(len(s) + 1) if fnmatch.fnmatchcase(s[:k], pat)]
                s = s[(max(cut) if op == "##" else min(cut)):] if cut else s
            elif op in ("%", "%%"):
                cut = [k for k in range(len(s) + 1) if fnmatch.fnmatchcase(s[k:], pat)]
                s = s[:(min(cut) if op == "%%" else max(cut))] if cut else s
            else:  # / and //: the text replaced (not a pattern)
                find, _, repl = arg.partition("/")
                find, repl = self.expand_text(find), self.expand_text(repl)
                s = s.replace(find, repl) if op == "//" else s.replace(find, repl, 1)
            out.append(s)
        return out if isinstance(v, list) else out[0]

    def substring(self, v: Any, name: str, offset: str, length: str | None, text: str) -> Any:
        """${V:offset[:length]}: characters of a value; of ${A[@]} and ${@} (whose element 0 is $0), elements. A
        negative offset or length counts from the end, as in bash."""
        off = self.arith(offset)
        n_ = None if length is None else self.arith(length)
        if v is None or off is None or (length is not None and n_ is None):
            return Unknown(text)
        seq = [self.script, *v] if name in ("@", "*") else v
        start = off + len(seq) if off < 0 else off
        if not 0 <= start <= len(seq):
            return seq[:0]
        end = len(seq) if n_ is None else min(len(seq), start + n_) if n_ >= 0 else len(seq) + n_
        if end < start or (n_ is not None and n_ < 0 and isinstance(seq, list)):  # bash: an error
            return Unknown(text)
        return seq[start:end]

    # ------------------------------------------------------------------ arithmetic
    def arith(self, expr: str) -> int | None:
        """$(( )) / (( )): integers of the script's values; assignments (i++, i += 1, i = 2) applied."""
        expr = expr.strip()
        if not expr:
            return 0
        if "," in expr:
            result = None
            for part in expr.split(","):
                result = self.arith(part)
            return result
        m = re.fullmatch(r"([A-Za-z_]\w*)\s*(\+\+|--)|(\+\+|--)\s*([A-Za-z_]\w*)", expr)
        if m:
            name = m.group(1) or m.group(4)
            old = self.arith(name)
            if old is None:
                return None
            new = old + (1 if "+" in (m.group(2) or m.group(3)) else -1)
            self.assign(name, str(new))
            return old if m.group(1) else new
        m = re.fullmatch(r"([A-Za-z_]\w*)\s*([-+*/%]?)=(?!=)\s*(.+)", expr)
        if m:
            rhs = self.arith(m.group(3))
            if rhs is None:
                return None
            if m.group(2):
                old = self.arith(m.group(1))
                if old is None:
                    return None
                rhs = arith_eval(f"{old} {m.group(2)} {rhs}")
                if rhs is None:
                    return None
            self.assign(m.group(1), str(rhs))
            return rhs

        def name(mm):
            n = mm.group(1)
            v = self.value(n) if not n.isdigit() else n
            if isinstance(v, list):
                v = v[0] if v else "0"
            if v is None or v == "":
                return "0" if v == "" else "\x00"
            if isinstance(v, Unknown) or not re.fullmatch(r"\s*-?\d+\s*", str(v)):
                return "\x00"
            return str(int(v))

        def expanded(mm):
            f = Fields()
            self.dollar(mm.group(0), f, True, False)
            got = "".join(f.done())
            return got if re.fullmatch(r"-?\d+", got) else "\x00"

        body = re.sub(r"\$\{[^}]*\}|\$[A-Za-z_]\w*|\$[0-9#]", expanded, expr)
        body = re.sub(r"(?<![\w.])([A-Za-z_]\w*)", name, body)
        if "\x00" in body:
            return None
        return arith_eval(body)


def brace_expand(text: str) -> list[str]:
    """Bash's brace expansion of one word as written: {a,b}, {1..5}, {05..10}, {a..e}, {1..9..2}, nested, outside
    quotes and ${...} / $(...); anything else stays one word."""
    lex, i = Lexer(text), 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
        elif c in "'\"":
            i = (text.find("'", i + 1) if c == "'" else lex.dquote(i)) + 1 or len(text)
        elif text.startswith(("${", "$(", "$[", "$'"), i):
            i = lex.brace(i + 1) + 1 if text[i + 1] == "{" else lex.paren(i + 1) + 1 if text[i + 1] == "(" else i + 2
        elif c == "{":
            depth, j, commas = 0, i, []
            while j < len(text):
                if text[j] == "\\":
                    j += 2
                    continue
                if text[j] in "'\"":
                    j = (text.find("'", j + 1) if text[j] == "'" else lex.dquote(j)) + 1 or len(text)
                    continue
                if text.startswith("${", j):
                    j = lex.brace(j + 1) + 1
                    continue
                depth += (text[j] == "{") - (text[j] == "}")
                if depth == 0:
                    break
                if text[j] == "," and depth == 1:
                    commas.append(j)
                j += 1
            if j >= len(text):
                return [text]
            pre, body, post = text[:i], text[i + 1:j], text[j + 1:]
            items = [text[a + 1:b] for a, b in zip([i, *commas], [*commas, j])] if commas else _sequence(body)
            if items is not None:
                return [w for item in items for w in brace_expand(pre + item + post)]
            i += 1
        else:
            i += 1
    return [text]


def _sequence(body: str) -> list[str] | None:
    """The items of {A..B[..STEP]}: integers (zero-padded as the wider of A and B when either is) or letters."""
    m = re.fullmatch(r"(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?|([A-Za-z])\.\.([A-Za-z])(?:\.\.(-?\d+))?", body)
    if not m:
        return None
    step = abs(int(m.group(3) or m.group(6) or 1)) or 1
    if m.group(1) is not None:
        a, b = int(m.group(1)), int(m.group(2))
        pad = max(len(m.group(1)), len(m.group(2))) if re.match(r"-?0\d", m.group(1) + " " + m.group(2)) or \
            re.search(r" -?0\d", " " + m.group(2)) else 0
        return [str(x).zfill(pad) if pad else str(x)
                for x in range(a, b + (1 if b >= a else -1), step if b >= a else -step)]
    a, b = ord(m.group(4)), ord(m.group(5))
    return [chr(x) for x in range(a, b + (1 if b >= a else -1), step if b >= a else -step)]


def change_case(s: str, op: str) -> str:
    """${V^^}, ${V^}, ${V,,}, ${V,} of one value."""
    change = str.upper if op[0] == "^" else str.lower
    return change(s) if len(op) == 2 else change(s[:1]) + s[1:]


def arith_eval(expr: str) -> int | None:
    """An integer expression (C operators) of numbers only (0x1F hexadecimal and 017 octal, as in bash)."""
    import ast
    import operator

    expr = re.sub(r"\b0[xX]([0-9a-fA-F]+)\b", lambda m: str(int(m.group(1), 16)), expr)
    expr = re.sub(r"\b0([0-7]+)\b", lambda m: str(int(m.group(1), 8)), expr)

    cond, rest = _ternary(expr)
    if rest is not None:  # c ? a : b (the lowest precedence, right to left)
        c = arith_eval(cond)
        return None if c is None else arith_eval(rest[0] if c else rest[1])
    py = expr.replace("&&", " and ").replace("||", " or ")
    py = re.sub(r"!(?!=)", " not ", py)
    py = re.sub(r"(?<![<>=!])/(?!/)", "//", py)
    try:
        tree = ast.parse(py.strip(), mode="eval")
    except SyntaxError:
        return None
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
           ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.Lt: operator.lt,
           ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Eq: operator.eq, ast.NotEq: operator.ne}

    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in ops:
            return ops[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.UAdd):
            return ev(n.operand)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            return int(not ev(n.operand))
        if isinstance(n, ast.BoolOp):
            vals = [ev(v) for v in n.values]
            return int(all(vals)) if isinstance(n.op, ast.And) else int(any(vals))
        if isinstance(n, ast.Compare) and len(n.ops) == 1 and type(n.ops[0]) in ops:
            return int(ops[type(n.ops[0])](ev(n.left), ev(n.comparators[0])))
        raise ValueError(n)

    try:
        return int(ev(tree.body))
    except (ValueError, ZeroDivisionError, TypeError):
        return None


def printf(fmt: str, args: list[str]) -> str | None:
    """printf's output for %s, %d / %i and %% directives and the escapes of $'...', the format used again while
    arguments are left (as bash does); None for any other directive."""
    parts = re.split(r"(%%|%.?)", ansi_c(fmt))
    if any(p.startswith("%") and p not in ("%s", "%d", "%i", "%%") for p in parts):
        return None
    out, args, first = [], list(args), True
    while first or args:
        first, used = False, 0
        for p in parts:
            if p in ("%s", "%d", "%i"):
                a = args.pop(0) if args else ""
                used += 1
                if p != "%s":
                    if not re.fullmatch(r"\s*[-+]?\d*\s*", a):
                        return None
                    a = str(int(a or 0))
                out.append(a)
            else:
                out.append("%" if p == "%%" else p)
        if not used:
            break
    return "".join(out)


def _ternary(expr: str) -> tuple[str, tuple[str, str] | None]:
    """`c ? a : b` split at its first `?` outside parentheses and the `:` that pairs with it."""
    depth, q = 0, None
    for k, c in enumerate(expr):
        depth += (c == "(") - (c == ")")
        if depth:
            continue
        if c == "?" and q is None:
            q, nested = k, 0
        elif c == "?":
            nested += 1
        elif c == ":" and q is not None:
            if not nested:
                return expr[:q], (expr[q + 1:k], expr[k + 1:])
            nested -= 1
    return expr, None


def test_expr(vals: list[str | None], double: bool) -> bool | None:
    """[ ... ] / [[ ... ]] of known words (None: a word the script does not set)."""
    for conn in ("||", "-o", "&&", "-a"):
        if conn in vals:
            k = vals.index(conn)
            left, right = test_expr(vals[:k], double), test_expr(vals[k + 1:], double)
            if conn in ("||", "-o"):
                return True if True in (left, right) else None if None in (left, right) else False
            return False if False in (left, right) else None if None in (left, right) else True
    if vals[:1] == ["!"]:
        v = test_expr(vals[1:], double)
        return None if v is None else not v
    if vals[:1] == ["("] and vals[-1:] == [")"]:
        return test_expr(vals[1:-1], double)
    if len(vals) == 1:
        return None if vals[0] is None else vals[0] != ""
    if len(vals) == 2:
        op, x = vals
        if op in ("-z", "-n"):
            return None if x is None else (x == "") == (op == "-z")
        return None  # -f, -d, -e ...: the files when the script runs
    if len(vals) == 3:
        a, op, b = vals
        if a is None or b is None:
            return None
        if op in ("=", "=="):
            return fnmatch.fnmatchcase(a, b) if double else a == b
        if op == "!=":
            return not fnmatch.fnmatchcase(a, b) if double else a != b
        if op == "=~":  # bash's extended regular expression, read as Python's (the same for what scripts test)
            try:
                return re.search(b, a) is not None
            except re.error:
                return None
        if op in ("-eq", "-ne", "-lt", "-le", "-gt", "-ge"):
            try:
                x, y = int(a), int(b)
            except ValueError:
                return None
            return {"-eq": x == y, "-ne": x != y, "-lt": x < y, "-le": x <= y, "-gt": x > y, "-ge": x >= y}[op]
        if op in ("<", ">"):
            return a < b if op == "<" else a > b
    return None


def loop_count(header: str, reader: Reader) -> int | None:
    """Iterations of `while (( i < N ))` / `while [ $i -lt $N ]` / `for ((i = A; i < N; i++))`, from the values
    the script holds when the loop starts."""
    def value(x: str) -> int | None:
        if x.lstrip("-").isdigit():
            return int(x)
        v = reader.value(x.lstrip("$").strip("{}"))
        return int(v) if isinstance(v, str) and not isinstance(v, Unknown) and v.lstrip("-").isdigit() else None

    m = re.search(r"\(\(\s*\$?\{?(\w+)\}?\s*(<=?)\s*\$?\{?(\w+)\}?\s*\)\)|\[\[?\s*\"?\$\{?(\w+)\}?\"?\s+-(lt|le)\s+"
                  r"\"?\$?\{?(\w+)\}?\"?\s*\]", header)
    if not m:
        return None
    var, op, bound = (m.group(1), m.group(2), m.group(3)) if m.group(1) else (m.group(4), m.group(5), m.group(6))
    start, end = value(var), value(bound)
    if start is None or end is None:
        return None
    return max(0, end - start + (op in ("<=", "le")))


def launch_point(w: list[str]) -> tuple[int | None, str, str]:
    """(index of the module word, module, the path when launched by path) of an OpenRLHF launch: `-m` / `--module
    openrlhf.cli.X`, or `python|deepspeed|torchrun ... openrlhf/cli/X.py`."""
    for k, x in enumerate(w):
        if (m := LAUNCH_MODULE.match(x)) and k and w[k - 1] in ("-m", "--module"):
            return k, m.group(1), ""
        if (m := LAUNCH_PATH.search(x)) and any(Path(r).name.startswith(("python", "deepspeed", "torchrun", "accelerate"))
                                                for r in w[:k]):
            return k, m.group(1), x
    return None, "", ""


def read_script(text: str, folder: Path | None = None, args: list[str] | None = None, name: str = "script") -> Script:
    """What the script runs: its OpenRLHF commands and the rest the importer names."""
    reader = Reader(folder, args, name)
    try:
        reader.read(text)
    except Exit:
        pass
    return Script(reader.found, reader.servers, reader.orphans, reader.unread, reader.undecided, reader.positional,
                  reader.exit_line)


def find_commands(text: str, folder: Path | None = None, args: list[str] | None = None) -> list[Command]:
    """The OpenRLHF commands a script launches, in order; `folder` is where `source FILE` looks."""
    return [c for c in read_script(text, folder, args).commands if c.module]


def flag_values(ws: list[str]) -> list[tuple[str, Any]]:
    """--flag v, --flag=v, --flag v1 v2 (nargs), --flag (a switch: True). Negative numbers are values."""
    out: list[tuple[str, Any]] = []
    for x in ws:
        if x.startswith("--") and len(x) > 2:
            name, eq, v = x[2:].partition("=")
            out.append((name, [v] if eq else []))
        elif out:
            out[-1][1].append(x)
    return [(n, True if not v else v[0] if len(v) == 1 else v) for n, v in out]


def launcher_flags(ws: list[str]) -> list[tuple[str, Any]]:
    if "--" in ws:  # ray job submit [options] -- python3 -m ...
        ws = ws[:ws.index("--")]
    return [(n, v) for n, v in flag_values(ws) if n]
