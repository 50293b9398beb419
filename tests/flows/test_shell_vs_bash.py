"""The launch-script reader (flows/openrlhf/shell.py) against bash itself: each script below sets V and then runs
`deepspeed --module openrlhf.cli.train_sft --pretrain "$V"`. Bash runs the same text with `deepspeed` defined as a
function that prints its arguments; the reader reads it without running anything. Both must give the same
--pretrain, or the reader must leave the value as written (a value it cannot know, which the importer names) where
this file says so. Nothing here is hand-computed: the expected value is what bash printed."""
from __future__ import annotations

import subprocess

import pytest

from flows.openrlhf.shell import find_commands, flag_values

LAUNCH = '\ndeepspeed --module openrlhf.cli.train_sft --pretrain "$V"\n'

# the reader gives bash's value
EXACT = [
    # parameter expansions
    'X=abc.tar.gz; V="${X#*.}"', 'X=abc.tar.gz; V="${X##*.}"', 'X=abc.tar.gz; V="${X%.*}"', 'X=abc.tar.gz; V="${X%%.*}"',
    'X=a-b-c; V="${X/-/_}"', 'X=a-b-c; V="${X//-/_}"', 'V="${U:-dflt}"', 'V="${U-dflt}"', 'U=; V="${U:-dflt}"',
    'U=; V="${U-dflt}"', 'V="${U:=set}$U"', 'U=x; V="${U:+alt}"', 'V="${U:+alt}none"', 'U=; V="${U+alt}"',
    'V="${U:-${W:-deep}}"', 'X=/p/q/; V="${X%/}"', 'X=hello; V="${#X}"',
    # arrays and positional arguments
    'A=(a b c); V="${#A[@]}"', 'A=(a b c); V="${A[1]}"', 'A=(a b c); V="${A[-1]}"', 'A=(a b c); A+=(d); V="${A[3]}${#A[*]}"',
    'A=(x.py y.py); V="${A[@]%.py}"', 'A=(a b); A[1]=z; V="${A[@]}"', 'declare -a A=(p q); V="${A[*]}"',
    'set -- a b c; V="$# $2 ${@:-none}"', 'set -- x.py y.py; V="${@%.py}"', 'set -- ; V="${@:-none}"', 'set -- a b; V="${*}"',
    # arithmetic
    'i=3; V=$((i * 2 + 1))', 'i=3; ((i++)); V=$i', 'i=3; ((i += 4)); V=$i', 'i=7; V=$(( i / 2 ))$(( i % 3 ))',
    'V=$(( 2 ** 10 ))', 'N=4; V=$(( N > 3 && N < 10 ))', 'N=4; V=$(( !N || 0 ))', 'V=$((-3 + +4))', 'x=1; V=$(( x, x + 5 ))',
    'i=3; V=$(( ++i ))$i', 'i=3; V=$(( i-- ))$i', 'i=8; ((i /= 2)); V=$i', 'a=2; V=$(( a == 2 ? 10 : a > 1 ? 20 : 30 ))',
    'a=3; V=$(( a == 2 ? 10 : a > 1 ? 20 : 30 ))', 'a=0; V=$(( a ? (a ? 1 : 2) : 3 ))',
    # quoting and substitutions that need nothing to run
    "V=$'a\\tb\\x41\\101\\u00e9\\n'", "V='single $quote'", 'V="dq \\$ \\" \\\\ x"', 'V=$(basename /a/b/run.sh .sh)',
    'V=$(dirname /a/b/run.sh)', 'V=$(echo -n hi there)', "V=$(cat <<'EOF'\nraw $HOME_X\nEOF\n)",
    # tests, branches, functions, lists
    'X=ab; if [[ $X == a* ]]; then V=glob; else V=no; fi', 'X=ab; if [ "$X" = "a*" ]; then V=lit; else V=no; fi',
    'X=5; if [ $X -gt 3 -a $X -lt 9 ]; then V=in; else V=out; fi', 'X=5; if [[ $X -le 3 || $X -ge 5 ]]; then V=or; else V=no; fi',
    'X=b; if [[ $X < c ]]; then V=less; else V=more; fi', 'X=; if [ -z "$X" ]; then V=empty; fi',
    'X=y; if [ -n "$X" ] && [ ! "$X" = n ]; then V=both; fi', 'X=5; if [[ ! ( $X -eq 4 ) ]]; then V=not4; fi',
    'X=3; if (( X > 2 )); then V=arith; elif (( X > 1 )); then V=elif; fi',
    'X=lora; case $X in full) V=f;; lo*|qlora) V=l;; *) V=other;; esac', 'X=qlora; case "$X" in full) V=f;; lo*|qlora) V=l;; esac',
    'X=zz; case $X in a) V=a;; *) V=star;; esac', 'f() { V="in-$1"; }; f arg', 'function g { local L=loc; V=$L; }; g',
    'V=one; V+=two', 'export V=exp; readonly R=1', 'V=x; [[ $V == x ]] && V=and || V=or', 'false || V=fallback',
    'true && V=chain', 'X=qwen2; if [[ $X =~ ^qw(en)?[0-9]$ ]]; then V=re; else V=no; fi', 'i=2; let i=i+3; V=$i',
    'let "i = 4 * 2"; V=$i', 'printf -v V "%d%%-%s" 7 x', 'printf -v V "%s," a b c', 'for s in only; do V=x$s; done',
    # substrings, case, bases
    'X=abcdef; V="${X:2}"', 'X=abcdef; V="${X:1:3}"', 'X=abcdef; V="${X: -2}"', 'X=abc; V="${X:1:-1}"', 'X=abc; V="${X:5}"',
    'A=(a b c d); V="${A[@]:1:2}"', 'set -- a b c; V="${@:2}"', 'X=AbC; V="${X,,}${X^^}${X^}${X,}"', 'A=(ab cd); V="${A[@]^^}"',
    'V=$(( 0x10 + 010 + 0x1f ))', 'N=2; V=$(( N << 2 ))$(( 7 & 3 | 8 ))$(( 6 ^ 3 ))',
    # brace expansion (words, loop items, array elements; not an assignment's value), seq
    'V=$(echo {01..03} {3..1} {a..e..2} {1..10..3} {-05..5..5})', 'V=$(echo x{a,b{1,2}}y "{a,b}" {a} \'{a,b}\'{c,d})',
    'X=p; V=$(echo ${X}{a,b})', 'A=({0..2}); V="${#A[@]}"', 'A=(--x={0..1}); V="${A[*]}"', 'V={a,b}', 'V=$(seq 3)$(seq 2 2 6)',
]
# the reader leaves what bash decides when it runs as written (the importer names it): an error, the environment, a
# printf format it does not read, and after a loop of more than one iteration what its body set (the loop is read
# once: shell.py's docstring)
KEPT = {
    'V=$(( 1 / 0 ))': "$V",  # bash: "division by 0", V unset
    'V=$(cat <<EOF\nline $HOME_X\nEOF\n)': "line $HOME_X",  # not set by the script: the environment may
    'V=${HOME_X:-~/x}': "~/x",  # the home of the user who runs it
    'printf -v V "%5.2f" 3': "$V",
    'for s in 1 2 3; do V=last$s; done': "$V",
    'i=0; while (( i < 3 )); do i=$((i+1)); V=w$i; done': "$V",
    'for i in {1..3}; do V=x$i; done': "$V", 'for g in {0..7}; do :; done; V=$g': "$g",
    'for i in $(seq 1 3); do V=x$i; done': "$V", 'for ((i = 0; i < 1; i++)); do :; done; V=$i': "$i",
    'IFS=, read -r A B <<< "x,y"; V=$B': "$B",  # read's fields split on an IFS of other characters than whitespace
    'X=Y; Y=ok; V=${!X}': "${!X}",  # an indirect expansion
}


def reader(script: str):
    (cmd,) = find_commands(script + LAUNCH)
    return dict(cmd.flags)["pretrain"]


def bash(script: str):
    out = subprocess.run(["bash", "-c", 'deepspeed() { printf "%s\\0" "$@"; }\n' + script + LAUNCH],
                         capture_output=True, text=True, timeout=30)
    words = out.stdout.split("\0")[:-1]
    assert words[:2] == ["--module", "openrlhf.cli.train_sft"], (script, out.stdout, out.stderr)
    return dict(flag_values(words[2:]))["pretrain"]


@pytest.mark.parametrize("script", EXACT)
def test_the_reader_expands_as_bash_does(script):
    assert reader(script) == bash(script)


@pytest.mark.parametrize("script", sorted(KEPT))
def test_what_bash_decides_at_run_time_stays_as_written(script):
    assert reader(script) == KEPT[script] != bash(script)
