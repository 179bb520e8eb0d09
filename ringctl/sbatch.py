"""What may reach an `#SBATCH` line of the batch script, and how it is written there.

sbatch reads the header of a batch script by rules of its own, not the shell's, so shell quoting
(`shlex.quote`) does not protect it. What this module relies on, from Slurm's source
(`src/sbatch/opt.c`: `_opt_batch_script` and `get_argument`, the same in 22.05 and in master;
`src/slurmd/common/fname.c`; `src/common/proc_args.c`; the sbatch man page):

- Header lines are lines that begin with exactly `#SBATCH` (or `#SLURM`); sbatch stops reading at
  the first line that is neither blank nor a `#` comment.
- Each header line is cut into words: whitespace separates words; `'...'` or `"..."` group; a
  backslash escapes the next character everywhere, *also inside single quotes* (so `'a\\'b'` is
  one word, and the `'` that bash would read as closing the quote does not close it); an unquoted
  `#` ends the line; an unmatched quote makes sbatch exit; a word that is exactly `hetjob` or
  `packjob` splits the job into components; a word that begins with `:` makes sbatch exit.
- The words then go to `getopt_long`: any word starting with `-` is an option; an unambiguous
  prefix is the option (`--part=x` is `--partition=x`); a later option overrides an earlier one;
  options on sbatch's command line override the header. So a value that smuggles a space (or
  whatever sbatch takes for one) into a header line adds options: `--export=ALL,BASH_FUNC_...`
  runs code in the job, a second `--partition=` replaces the configured one.
- `--output`/`--error` are filename patterns: `%j`, `%x`, ... are replaced, `%%` is one `%`, and
  a backslash anywhere in the name is removed and turns every replacement off. `--chdir` is a
  plain path (no replacement).
- `--signal=[{R|B}:]SIG[@TIME]`: SIG is a number or one of HUP INT QUIT ABRT KILL ALRM TERM USR1
  USR2 URG CONT STOP TSTP TTIN TTOU XCPU (an optional `SIG` prefix, any case); TIME is 0..65535
  seconds (60 when left out). `--time` formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, read with
  C `int`s.

So every value that reaches a header line passes a strict check for what its option can hold
(`RULES`: a character set and a form per option, full-match, no whitespace except inside a
comment or a path, never a quote, a backslash or a control character). Anything else is refused
with a one-line error naming the config key. A checked value is then written as one word:
bare, or in single quotes where it holds a space or `#` (which sbatch's parser reads back to the
same text, as nothing in it is special inside single quotes). `extra_sbatch` lines must be one
known option (`EXTRA_OPTIONS`) with its value checked the same way; options ringctl sets itself,
or that change what the job runs or where its files go, are refused (`RESERVED`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from .errors import UserError
from .jobdir import BATCH_LOG
from .text import echo

_SLURM_SIGNALS = (
    "HUP INT QUIT ABRT KILL ALRM TERM USR1 USR2 URG CONT STOP TSTP TTIN TTOU XCPU".split()
)
# KILL and STOP cannot be caught: sent before the time limit, the workers could not finish the
# current unit of work and write what they have, which is what slurm.signal is for.
_UNCATCHABLE = ("KILL", "STOP")
# The signals a worker takes as "finish the unit, save, stop" (it handles the one slurm.signal
# names). URG and CONT are ignored by default and TSTP/TTIN/TTOU stop a process: as warnings
# they did nothing or stalled the job until its limit, so they are refused.
WORKER_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "ALRM", "XCPU", "QUIT", "ABRT")
MAX_TIME_S = 365 * 86400  # far beyond any site's limit, far below a C int of seconds
MAX_SIGNAL_LEAD_S = 0xFFFF  # sbatch keeps the lead time in 16 bits


def slurm_time_seconds(value) -> int | None:
    """Slurm's --time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds; None when the
    text is not one of them or a field has more digits than Slurm's C `int`s can hold. ASCII
    digits, nothing around them: `\\d` took '٣٠' and a strip took ' 90', both written to
    the header as given."""
    text = str(value)
    m = re.fullmatch(r"(?:([0-9]{1,6})-)?([0-9]{1,8})(?::([0-9]{1,8}))?(?::([0-9]{1,8}))?", text)
    if m is None:
        return None
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if days is not None:  # D-H[:M[:S]]
        return ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    if b is None:  # minutes
        return a * 60
    if c is None:  # M:S
        return a * 60 + b
    return (a * 60 + b) * 60 + c


def _time_problem(text: str) -> str | None:
    seconds = slurm_time_seconds(text)
    if seconds is None:
        return f"{text!r} is not a Slurm time (e.g. 90, 1:30:00, 2-00:00:00)"
    if seconds < 1:
        return f"{text!r} is no time at all"
    if seconds > MAX_TIME_S:
        return f"{text!r} is more than 365 days"
    return None


def signal_lead(text: str) -> tuple[str, int] | None:
    """`USR1@120` -> ("USR1", 120); the lead defaults to 60 s like sbatch. None: not SIG[@S]."""
    m = re.fullmatch(r"(?:SIG)?([A-Za-z0-9]{1,8})(?:@([0-9]{1,6}))?", text)
    if m is None:
        return None
    return m.group(1).upper(), int(m.group(2) or 60)


def _signal_problem(text: str) -> str | None:
    parsed = signal_lead(text)
    if parsed is None:
        return f"{text!r} is not SIG[@SECONDS] (e.g. USR1@120)"
    name, seconds = parsed
    if name not in _SLURM_SIGNALS:
        known = " ".join(s for s in _SLURM_SIGNALS if s not in _UNCATCHABLE)
        return f"{text!r}: {name} is not a signal name Slurm knows ({known})"
    if name in _UNCATCHABLE:
        return f"{text!r}: SIG{name} cannot be caught, so the workers could not stop cleanly"
    if name not in WORKER_SIGNALS:
        return (
            f"{text!r}: the workers do not take SIG{name} as a warning (they take "
            f"{' '.join(WORKER_SIGNALS)})"
        )
    if not 1 <= seconds <= MAX_SIGNAL_LEAD_S:
        return f"{text!r}: the lead time must be 1 to {MAX_SIGNAL_LEAD_S} seconds"
    return None


def _switches_problem(text: str) -> str | None:
    count, sep, wait = text.partition("@")
    if not re.fullmatch(r"[1-9][0-9]{0,3}", count):
        return f"{text!r} is not COUNT[@MAX_WAIT] (e.g. 1 or 1@00:10:00)"
    return _time_problem(wait) if sep else None


def _comment_problem(text: str) -> str | None:
    bad = sorted({c for c in text if not (" " <= c <= "~") or c in "\"'\\"})
    if bad:
        shown = " ".join(repr(c) for c in bad)
        return f"may hold printable ASCII except quotes and backslashes, not {shown}"
    if text != text.strip():
        return "must not begin or end with a space"
    return None


@dataclass(frozen=True)
class Rule:
    """What one option's value may be: a full-match pattern (or a check) and a description."""

    what: str  # for errors: "a partition name or a comma-separated list of them"
    pattern: str | None = None
    check: Callable[[str], str | None] | None = None
    max_len: int = 256

    def problem(self, text: str) -> str | None:
        if not text:
            return "must not be empty"
        # ASCII: Unicode case folding would take 'ſ' for 's' and 'K' (Kelvin) for 'k'
        if self.pattern is not None and not re.fullmatch(self.pattern, text, re.ASCII):
            return f"{echo(text, 100)} is not {self.what}"
        if len(text) > self.max_len:
            return f"is longer than {self.max_len} characters"
        return self.check(text) if self.check else None


_WORD = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"  # an account, a QOS, a partition, a reservation...
_WORDS = rf"{_WORD}(?:,{_WORD})*"
_COUNT = r"[1-9][0-9]{0,5}"
_MEM = r"[0-9]{1,9}[KMGTkmgt]?"
_NODES = r"[A-Za-z0-9_.\[\],-]+"  # a hostlist: n[1-4],gpu07
_MAIL_TYPES = (
    "NONE BEGIN END FAIL REQUEUE ALL INVALID_DEPEND STAGE_OUT TIME_LIMIT TIME_LIMIT_90 "
    "TIME_LIMIT_80 TIME_LIMIT_50 ARRAY_TASKS"
).split()

RULES: dict[str, Rule] = {
    "job-name": Rule(
        "a job name (letters, digits, inner spaces and _ . + : @ , = -)",
        r"[A-Za-z0-9_](?:[A-Za-z0-9_ .+:@,=-]*[A-Za-z0-9_.+:@,=-])?",
        max_len=200,
    ),
    "account": Rule("an account name (letters, digits, _ . -)", _WORD, max_len=64),
    "partition": Rule("a partition name or a comma-separated list of them", _WORDS),
    "qos": Rule("a QOS name (letters, digits, _ . -)", _WORD, max_len=64),
    "reservation": Rule("a reservation name or a comma-separated list of them", _WORDS),
    "wckey": Rule("a wckey (letters, digits, _ . -)", _WORD, max_len=64),
    "constraint": Rule(
        "a feature expression (features of letters, digits, _ . : = +, joined by & | , * ! "
        "brackets and parentheses; no spaces)",
        r"[A-Za-z0-9_.:=+*&|,!()\[\]-]+",
        max_len=1024,
    ),
    "comment": Rule("a comment", check=_comment_problem, max_len=1000),
    "time": Rule("a Slurm time", check=_time_problem, max_len=20),
    "time-min": Rule("a Slurm time", check=_time_problem, max_len=20),
    "signal": Rule("SIG[@SECONDS]", check=_signal_problem, max_len=20),
    "switches": Rule("COUNT[@MAX_WAIT]", check=_switches_problem, max_len=30),
    "nodes": Rule("a node count", _COUNT),
    "ntasks-per-node": Rule("a task count", _COUNT),
    "gpus-per-node": Rule("a GPU count", _COUNT),
    "cpus-per-task": Rule("a CPU count", _COUNT),
    "cpus-per-gpu": Rule("a CPU count", _COUNT),
    "gpus-per-task": Rule("a GPU count ([TYPE:]COUNT)", rf"(?:{_WORD}:)?{_COUNT}"),
    "mem": Rule("a memory size (e.g. 64G, 0 for all of a node's)", _MEM),
    "mem-per-cpu": Rule("a memory size (e.g. 4G)", _MEM),
    "mem-per-gpu": Rule("a memory size (e.g. 80G)", _MEM),
    "tmp": Rule("a disk size (e.g. 100G)", _MEM),
    "gres": Rule(
        "a GRES list (NAME[:TYPE][:COUNT],...)", rf"{_WORD}(?::{_WORD})*(?:,{_WORD}(?::{_WORD})*)*"
    ),
    "licenses": Rule(
        "a license list (NAME[:COUNT],...)", rf"{_WORD}(?::[0-9]+)?(?:,{_WORD}(?::[0-9]+)?)*"
    ),
    "mail-type": Rule(
        f"a comma-separated list of {', '.join(_MAIL_TYPES)}",
        rf"(?i:(?:{'|'.join(_MAIL_TYPES)})(?:,(?:{'|'.join(_MAIL_TYPES)}))*)",
    ),
    "mail-user": Rule("a user or an e-mail address", r"[A-Za-z0-9._+-]+(?:@[A-Za-z0-9.-]+)?"),
    "begin": Rule(
        "a Slurm time of day or date (e.g. now+1hour, 2026-12-01T10:00)", r"[A-Za-z0-9:+-]+"
    ),
    "deadline": Rule("a Slurm date (e.g. 2026-12-01T10:00)", r"[A-Za-z0-9:+-]+"),
    "dependency": Rule(
        "a dependency list (e.g. afterok:123:456,singleton)", r"[A-Za-z0-9_:,?+]+", max_len=1024
    ),
    "nice": Rule("a nice adjustment (an integer)", r"[+-]?[0-9]{1,5}"),
    "exclude": Rule("a host list (e.g. n[1-4],gpu07)", _NODES, max_len=4096),
    "nodelist": Rule("a host list (e.g. n[1-4],gpu07)", _NODES, max_len=4096),
    "hint": Rule(
        "compute_bound, memory_bound, multithread or nomultithread",
        r"compute_bound|memory_bound|multithread|nomultithread",
    ),
    "open-mode": Rule("append or truncate", r"append|truncate"),
    "kill-on-invalid-dep": Rule("yes or no", r"yes|no"),
}

# Options an extra_sbatch line may carry: with a value (checked by its rule) or bare switches.
EXTRA_OPTIONS = (
    "comment reservation wckey mail-type mail-user begin deadline dependency nice exclude "
    "nodelist hint kill-on-invalid-dep time-min gres licenses gpus-per-task "
    "cpus-per-gpu mem-per-cpu mem-per-gpu tmp"
).split()
EXTRA_SWITCHES = ("contiguous", "spread-job", "use-min-nodes", "oversubscribe")

# Options ringctl sets itself (say which key to use), or that change what the job runs, how,
# or where its files go (never passed on).
RESERVED: dict[str, str] = {
    "job-name": "set `name` instead",
    "nodes": "set `nodes` instead",
    "ntasks-per-node": "set `tasks_per_node` instead",
    "gpus-per-node": "set `gpus_per_node` instead",
    "exclusive": "set `slurm.exclusive` instead",
    "requeue": "set `slurm.requeue` instead",
    "no-requeue": "set `slurm.requeue` instead",
    "open-mode": "ringctl appends to the logs, which keeps a requeued attempt's",
    **{
        opt: f"set `slurm.{opt.replace('-', '_')}` instead"
        for opt in "partition account qos time constraint switches signal cpus-per-task mem".split()
    },
    **{
        opt: "ringctl sets the job directory and its logs itself"
        for opt in "chdir output error input".split()
    },
    **{
        opt: "it changes what the job runs or its environment"
        for opt in (
            "export export-file get-user-env propagate wrap uid gid array container "
            "ntasks ntasks-per-core ntasks-per-socket ntasks-per-gpu hold parsable wait "
            "test-only batch cluster clusters burst-buffer bbf"
        ).split()
    },
}

CONFIG_OPTIONS = (  # config key -> option, as the header writes them, in this order
    ("name", "job-name"),
    ("nodes", "nodes"),
    ("tasks_per_node", "ntasks-per-node"),
    ("gpus_per_node", "gpus-per-node"),
    ("slurm.cpus_per_task", "cpus-per-task"),
    ("slurm.mem", "mem"),
    ("slurm.partition", "partition"),
    ("slurm.account", "account"),
    ("slurm.qos", "qos"),
    ("slurm.time", "time"),
    ("slurm.constraint", "constraint"),
    ("slurm.switches", "switches"),
    ("slurm.signal", "signal"),
)


def value_problem(option: str, value) -> str | None:
    """Why `value` cannot be given to `--option` on a header line; None when it can."""
    rule = RULES.get(option)
    if rule is None:
        return f"--{option} is not an option ringctl writes"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value!r} is not a number"
    return rule.problem(str(value))


def parse_extra(item) -> tuple[str, str | None]:
    """One extra_sbatch line (`--mail-type=END`, `--mail-type END`, `--contiguous`) -> (option,
    value or None), or ValueError saying why it cannot be passed on."""
    text = str(item).strip()
    m = re.fullmatch(r"--([a-z][a-z0-9-]*)(?:(?:=| +)(.*))?", text, re.S)
    if m is None:
        if re.match(r"-[A-Za-z]", text):
            raise ValueError(f"{text!r}: use the long form of the option (e.g. --mail-type=END)")
        raise ValueError(f"{text!r} is not one --option=value")
    option, value = m.group(1), m.group(2)
    if option in RESERVED:
        raise ValueError(f"--{option} cannot be given here: {RESERVED[option]}")
    if option in EXTRA_SWITCHES:
        if value is not None:
            raise ValueError(f"--{option} takes no value")
        return option, None
    if option not in EXTRA_OPTIONS:
        allowed = ", ".join(f"--{o}" for o in (*EXTRA_OPTIONS, *EXTRA_SWITCHES))
        raise ValueError(f"--{option} is not an option ringctl passes on (it passes {allowed})")
    if value is None:
        raise ValueError(f"--{option} needs a value (--{option}=...)")
    value = _unquote(value)
    why = value_problem(option, value)
    if why:
        raise ValueError(f"--{option}: {why}")
    return option, value


def _unquote(value: str) -> str:
    """`"a b"` or `'a b'` -> `a b` (one pair around the whole value, as a user types it)."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    if value[:1] in ("'", '"') or value[-1:] in ("'", '"'):
        raise ValueError(f"{value!r}: unbalanced quote")
    return value


def path_problem(path: str) -> str | None:
    """Why a directory cannot go into --chdir or an --output file name; None when it can."""
    if any(c < " " or c == "\x7f" for c in path):
        return f"{path!r} holds control characters"
    if "\\" in path:
        return f"{path!r} holds a backslash, which Slurm removes from --output file names"
    return None


def header_words(line: str) -> list[str]:
    """The words sbatch reads from one `#SBATCH` line (a port of `get_argument` in Slurm's
    src/sbatch/opt.c, for checking what this module writes; het-job separators aside): ValueError
    where sbatch would exit (an unmatched quote, a word starting with `:`)."""
    if not line.startswith("#SBATCH"):
        raise ValueError(f"not an #SBATCH line: {line!r}")
    text, i, words = line[len("#SBATCH") :], 0, []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return words
        if text[i] == ":":
            raise ValueError(f"sbatch: unexpected `:` in {line!r}")
        word, quote, escaped, started = [], "", False, False
        while i < len(text) and (quote or not text[i].isspace()):
            c = text[i]
            i += 1
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
                continue
            elif quote:
                if c == quote:
                    quote = ""
                    continue
            elif c in "'\"":
                quote, started = c, True
                continue
            elif c == "#":
                i = len(text)
                break
            word.append(c)
            started = True
        if quote:
            raise ValueError(f"sbatch: unmatched {quote} in {line!r}")
        if started:
            words.append("".join(word))


def header_word(option: str, value: str | None = None) -> str:
    """`--option=value` as one word of sbatch's header syntax. The value must have passed its
    rule: nothing in it may be a quote, a backslash or a control character."""
    if value is None:
        return f"--{option}"
    text = str(value)
    if any(c in text for c in "'\"\\") or any(c < " " or c == "\x7f" for c in text):
        raise ValueError(f"--{option}: {text!r} cannot be written on an #SBATCH line")
    if re.fullmatch(r"[A-Za-z0-9_.+:@,=/%*&|!()\[\]~-]*", text):
        return _read_back(f"--{option}={text}", f"--{option}={text}")
    # spaces or `#`: literal inside single quotes, for sbatch too
    return _read_back(f"--{option}='{text}'", f"--{option}={text}")


def _read_back(word: str, meant: str) -> str:
    """The word, once sbatch's reading of it is checked to be exactly `meant` (and one word)."""
    read = header_words(f"#SBATCH {word}")
    if read != [meant]:
        raise ValueError(f"{meant!r} would reach sbatch as {read!r}")
    return word


BATCH_LOG_PATTERN = BATCH_LOG.format(job_id="%j")  # Slurm writes the job id for %j


def output_pattern(directory: str) -> str:
    """`<directory>/logs/batch-%j.out` (jobdir.BATCH_LOG) as a Slurm filename pattern: a `%`
    of the directory is doubled (Slurm would read `%j`, `%x`... in it), the name keeps its
    `%j`. A backslash cannot be written at all (Slurm removes it and then replaces nothing):
    UserError."""
    why = path_problem(directory)
    if why:
        raise UserError(f"job directory: {why}")
    return f"{directory.replace('%', '%%').rstrip('/')}/{BATCH_LOG_PATTERN}"


def batch_log_arguments(directory: str) -> list[str]:
    """sbatch's command-line arguments that put the job in `directory` and its batch log in
    `directory/logs/batch-<jobid>.out` (for the backends: `%` escaped, `\\` refused)."""
    log = output_pattern(directory)
    return [f"--chdir={directory}", f"--output={log}", f"--error={log}"]


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def check_config(cfg, bad: Callable[[str, str], Exception]) -> None:
    """Every config value that reaches a header line, checked by its option's rule (`bad(key,
    why)` builds the error to raise), and each extra_sbatch line parsed."""
    for key, option in CONFIG_OPTIONS:
        value = _get(cfg, key)
        if not _present(value):
            continue
        why = value_problem(option, value)
        if why:
            raise bad(key, why)
    for i, item in enumerate(cfg.slurm.extra_sbatch):
        try:
            parse_extra(item)
        except ValueError as err:
            raise bad(f"slurm.extra_sbatch[{i}]", str(err)) from None


def _present(value) -> bool:
    """Whether a key writes its option: unset (None), off (False), 0 and "" write nothing."""
    return value is not None and value is not False and value != 0 and value != ""


def header_lines(cfg, job_dir: str | None = None) -> list[str]:
    """The `#SBATCH` lines of a job: each value checked again here (a config that did not come
    through `load_job` gets the same refusal, as a UserError naming the key). With `job_dir`
    (absolute, as the cluster sees it) the script sets its own --chdir and --output."""

    def bad(key: str, why: str) -> UserError:
        return UserError(f"{key}: {why}")

    check_config(cfg, bad)
    words = []
    for key, option in CONFIG_OPTIONS:
        value = _get(cfg, key)
        if _present(value) or key == "nodes":
            words.append(header_word(option, str(value)))
    if cfg.slurm.exclusive:
        words.append(header_word("exclusive"))
        if not _asks_memory(cfg):  # all the node's memory, as its CPUs and GPUs
            words.append(header_word("mem", "0"))
    # Always said, never left to the cluster's JobRequeue default (1: requeue after a node
    # failure); append, so that a requeued attempt's batch log is still there for the script
    # to keep (templates/slurm.sh.j2: "a rerun by Slurm"), where truncate would erase it.
    words.append(header_word("requeue" if cfg.slurm.requeue else "no-requeue"))
    words.append(header_word("open-mode", "append"))
    if job_dir:
        job_dir = str(job_dir)
        why = path_problem(job_dir)
        if why:
            raise bad("job_dir", why)
        words.append(_path_word("chdir", job_dir))
        words.append(_path_word("output", output_pattern(job_dir)))
    else:
        words.append(f"--output={BATCH_LOG_PATTERN}")
    for item in cfg.slurm.extra_sbatch:
        words.append(header_word(*parse_extra(item)))
    return [f"#SBATCH {word}" for word in words]


MEMORY_OPTIONS = ("mem-per-cpu", "mem-per-gpu")  # --mem's alternatives (extra_sbatch)


def _asks_memory(cfg) -> bool:
    """Whether the job asks for memory itself: slurm.mem, or --mem-per-cpu/--mem-per-gpu in
    extra_sbatch (sbatch refuses --mem beside them: "mutually exclusive")."""
    extra = {parse_extra(item)[0] for item in cfg.slurm.extra_sbatch}
    return _present(_get(cfg, "slurm.mem")) or bool(extra & set(MEMORY_OPTIONS))


def _path_word(option: str, path: str) -> str:
    """A checked path (no backslash, no control character) as one header word: in single
    quotes, or in double quotes when it holds a single quote."""
    if "'" not in path:
        return _read_back(f"--{option}='{path}'", f"--{option}={path}")
    if '"' not in path:
        return _read_back(f'--{option}="{path}"', f"--{option}={path}")
    raise UserError(f"job_dir: {path!r} holds both kinds of quote: it cannot pass an #SBATCH line")
