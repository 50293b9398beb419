"""The OpenRLHF commands of a shell script, as the script would run them (read by flows/openrlhf_import.py).

Not a shell: it follows what OpenRLHF's example scripts do. Line continuations and comments; `VAR=value`
(also `export` / `readonly` / `local`), `${VAR:-default}`, bash arrays (`ARGS=( ... )` over several lines,
expanded by `"${ARGS[@]}"`) and `read -r -d '' VAR <<EOF` blocks are substituted; `source FILE ARGS` reads FILE
from the script's folder with its positional arguments; `if [[ A == B ]]` / `!=` is evaluated when both sides
are known (so `train_dpo_llama.sh` sourced with `slurm` launches nothing itself), other conditions are taken as
true; a command inside `bash -c "..."` (under srun), after `ray job submit ... --` or `torchrun ... -m` is found;
a `while (( $i < $N ))` loop's iteration count is read from the script's values. A value assigned inside a branch
whose condition is unknown, or from `$(...)`, is left as `$VAR` in the command and named as unresolved.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONTROL = {";", "&&", "||", "|", "&", ";;"}


@dataclass
class Loop:
    line: int
    header: str  # the `while ...` line as written
    iterations: int | None  # None: the bound is not a value the script sets


@dataclass
class Command:
    module: str  # train_sft ...
    launcher: list[tuple[str, Any]]  # (flag, value) before the module (deepspeed's, torchrun's, ray job submit's)
    flags: list[tuple[str, Any]]  # (flag as written, value: str, list of str, or True for a bare flag)
    line: int
    unresolved: list[str] = field(default_factory=list)  # $VARs the script does not set simply
    runner: str = ""  # deepspeed, torchrun, python, ray
    source: str = ""  # the file the command is in, when it is a sourced one
    loop: Loop | None = None

    @property
    def dialect(self) -> str:
        return "v0.10+ dotted flags" if any("." in f for f, _ in self.flags) else "v0.9 flat flags"


def logical_lines(text: str) -> list[tuple[int, str, str, str | None]]:
    """(line number, text, kind, name): kind "line" with continuations joined, "heredoc" (a `read -r -d '' VAR
    <<EOF` block's body as one line, name VAR) or "array" (`VAR=( ... )`'s words, name VAR)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        start, line = i + 1, lines[i]
        heredoc = re.match(r"\s*read\s+(?:-\w+\s+(?:''\s+)?)*(\w+)\s*<<-?\s*['\"]?(\w+)['\"]?\s*$", line)
        array = re.match(r"\s*(?:(?:readonly|export|local|declare(?:\s+-\w+)?)\s+)?(\w+)=\((.*)$", line)
        if heredoc:
            var, end = heredoc.groups()
            body = []
            i += 1
            while i < len(lines) and lines[i].strip() != end:
                body.append(lines[i])
                i += 1
            out.append((start, " ".join(b.rstrip().removesuffix("\\") for b in body), "heredoc", var))
        elif array and not array.group(2).startswith("("):  # not VAR=$((...)) arithmetic
            var, rest, body = array.group(1), array.group(2), []
            while True:  # up to the line whose code (comment dropped) ends with `)`
                code = re.sub(r"(^|\s)#.*$", "", rest).rstrip()
                body.append(code[:-1] if code.endswith(")") else code.removesuffix("\\"))
                if code.endswith(")") or i + 1 >= len(lines):
                    break
                i += 1
                rest = lines[i]
            out.append((start, "\n".join(body), "array", var))
        else:
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            out.append((start, line, "line", None))
        i += 1
    return out


def substitute(text: str, env: dict[str, Any]) -> str:
    """$VAR, ${VAR}, ${VAR:-default} and arrays ("${A[@]}", ${A[*]}, ${A[0]}) of the values the script sets
    (others stay as written)."""
    def array(m):
        v = env.get(m.group(1))
        if not isinstance(v, list):
            return m.group(0)
        if m.group(2) in ("@", "*"):
            return shlex.join(v)
        return shlex.quote(v[int(m.group(2))]) if int(m.group(2)) < len(v) else ""

    def scalar(m):
        name, default = m.group(1) or m.group(3), m.group(2)
        v = env.get(name)
        if v is None:
            return default if default is not None else m.group(0)
        return shlex.join(v) if isinstance(v, list) else v

    text = re.sub(r"\"?\$\{(\w+)\[(@|\*|\d+)\]\}\"?", array, text)
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+|\d)", scalar, text)


def tokens(line: str) -> list[str]:
    """Shell words and control operators (;, &&, |, ...) of a line; comments dropped."""
    line = re.sub(r"(?<![\w.-])\d*[<>]{1,2}&\d+", " ", line)  # 2>&1: no word of the command
    line = re.sub(r"(?<![\w.-])\d+(?=[<>])", " ", line)  # the fd of 2> log
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lex.whitespace_split = True
    try:
        return list(lex)
    except ValueError:  # unbalanced quotes: not a line we read
        return []


def simple_commands(ws: list[str]) -> list[list[str]]:
    """The simple commands of a token list, without redirections (`&>> log`, `> out`)."""
    out, cur, i = [], [], 0
    while i < len(ws):
        w = ws[i]
        if w in CONTROL:
            out.append(cur)
            cur = []
        elif set(w) <= set("<>&") and set(w) & set("<>"):  # a redirection and its target
            i += 1
        else:
            cur.append(w)
        i += 1
    return [c for c in out + [cur] if c]


def evaluate(condition: str, env: dict[str, Any]) -> bool | None:
    """`[[ A == B ]]`, `[ A != B ]` with both sides known; None: a condition this does not evaluate."""
    ws = [w for w in tokens(substitute(condition, env)) if w not in ("[[", "]]", "[", "]")]
    if len(ws) == 3 and ws[1] in ("==", "=", "!=") and not any("$" in w for w in ws):
        return (ws[0] == ws[2]) == (ws[1] != "!=")
    return None


def loop_count(header: str, env: dict[str, Any]) -> int | None:
    """Iterations of `while (( $i < $N ))` / `while [ $i -lt $N ]` / `for ((i = A; i < N; i++))`."""
    def value(x: str) -> int | None:
        v = env.get(x.lstrip("$"), x) if not x.isdigit() else x
        return int(v) if isinstance(v, str) and v.isdigit() else None

    m = re.search(r"\(\(\s*\$?(\w+)\s*(<=?)\s*\$?(\w+)\s*\)\)|\[\[?\s*\$?(\w+)\s+-(lt|le)\s+\$?(\w+)\s*\]", header)
    if m:
        var, op, bound = (m.group(1), m.group(2), m.group(3)) if m.group(1) else (m.group(4), m.group(5), m.group(6))
        start, end = value(var), value(bound)
    else:
        m = re.search(r"for\s*\(\(\s*(\w+)\s*=\s*(\w+)\s*;\s*\w+\s*(<=?)\s*\$?(\w+)", header)
        if not m:
            return None
        start, op, end = value(m.group(2)), m.group(3), value(m.group(4))
    if start is None or end is None:
        return None
    return max(0, end - start + (op in ("<=", "le")))


class Reader:
    def __init__(self, folder: Path | None):
        self.folder, self.env, self.found = folder, {str(i): "" for i in range(1, 10)}, []

    def read(self, text: str, source: str = "", at: int | None = None, outer: list | None = None) -> None:
        blocks: list[tuple[str, Any]] = list(outer or [])  # ("if", True/False/None), ("loop", Loop), ("fn", None)
        for no, line, kind, name in logical_lines(text):
            no = at or no
            known = all(v is True for k, v in blocks if k == "if") and not any(k == "fn" for k, _ in blocks)
            if kind == "heredoc":  # substituted where it is used: `deepspeed --module $training_commands`
                if known:
                    self.env[name] = substitute(line, self.env)
                continue
            if kind == "array":
                if known:
                    self.env[name] = [w for part in line.splitlines() for w in tokens(substitute(part, self.env))]
                continue
            s = line.strip()
            if (m := re.match(r"(?:function\s+)?\w+\s*\(\)\s*\{?\s*$", s)):
                blocks.append(("fn", None))
                continue
            if s == "}" and blocks and blocks[-1][0] == "fn":
                blocks.pop()
                continue
            if (m := re.match(r"(el)?if\s+(.*?)\s*;\s*then\s*$", s)):
                if m.group(1) and blocks and blocks[-1][0] == "if":
                    blocks.pop()
                blocks.append(("if", evaluate(m.group(2), self.env)))
                continue
            if s == "else" and blocks and blocks[-1][0] == "if":
                v = blocks.pop()[1]
                blocks.append(("if", None if v is None else not v))
                continue
            if re.match(r"fi\b", s) and blocks and blocks[-1][0] == "if":
                blocks.pop()
                continue
            if (m := re.match(r"(while|until|for)\s+(.*?)\s*;?\s*do\s*$", s)):
                blocks.append(("loop", Loop(no, s, loop_count(s, self.env))))
                continue
            if re.match(r"done\b", s) and blocks and blocks[-1][0] == "loop":
                blocks.pop()
                continue
            if any(k == "fn" for k, _ in blocks) or any(v is False for k, v in blocks if k == "if"):
                continue  # a function's body runs where it is called; a branch not taken
            assign = re.match(r"(?:(?:export|readonly|local|declare(?:\s+-\w+)?)\s+)?(\w+)=(.*)$", s)
            if assign and "openrlhf.cli." not in s:  # not `VAR=x python -m openrlhf...`
                if known and "$(" not in s and "`" not in s:
                    self.env[assign.group(1)] = " ".join(tokens(substitute(assign.group(2), self.env)))
                continue
            loop = next((v for k, v in reversed(blocks) if k == "loop"), None)
            for cmd in simple_commands(tokens(substitute(line, self.env))):
                self.command(cmd, no, source, loop, blocks)

    def command(self, w: list[str], no: int, source: str, loop: Loop | None, blocks: list) -> None:
        if w[0] in ("source", ".") and len(w) > 1:
            self.source(w[1], w[2:], no)
            return
        at = next((k for k, x in enumerate(w) if x.startswith("openrlhf.cli.")), None)
        if at is None or at == 0 or w[at - 1] not in ("--module", "-m"):
            for x in w:  # `bash -c "... torchrun -m openrlhf.cli.X ..."` (under srun): the command inside
                if "openrlhf.cli." in x and re.search(r"\s", x.strip()):
                    self.read(x, source, at=no, outer=blocks)
            return
        unresolved = sorted({m for x in w for m in re.findall(r"\$\{?\w+\}?", x)})
        runner = Path(w[0]).name
        runner = "python" if runner.startswith("python") else runner
        self.found.append(Command(w[at].removeprefix("openrlhf.cli."), launcher_flags(w[:at - 1]),
                                  flag_values(w[at + 1:]), no, unresolved, runner, source, loop))

    def source(self, name: str, args: list[str], no: int) -> None:
        path = (self.folder / name) if self.folder and not Path(name).is_absolute() else Path(name)
        if "$" in name or not path.is_file():
            self.found.append(Command("", [], [], no, [f"source {name}"]))  # named in the error if nothing is found
            return
        saved = {str(i): self.env[str(i)] for i in range(1, 10)}
        self.env.update({str(i): (args[i - 1] if i <= len(args) else "") for i in range(1, 10)})
        self.read(path.read_text(), source=name)
        self.env.update(saved)


def find_commands(text: str, folder: Path | None = None) -> list[Command]:
    """The OpenRLHF commands a script launches, in order; `folder` is where `source FILE` looks."""
    reader = Reader(folder)
    reader.read(text)
    return [c for c in reader.found if c.module]


def unread_sources(text: str, folder: Path | None = None) -> list[str]:
    reader = Reader(folder)
    reader.read(text)
    return [c.unresolved[0] for c in reader.found if not c.module]


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
