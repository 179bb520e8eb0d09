"""What reaches sbatch from a job config: hostile values through every `#SBATCH` key, read back
by the real sbatch of the test cluster.

The oracle is sbatch itself: `sbatch --hold -v` prints the options it parsed ("defined
options") before anything else, so a value that added or changed an option shows there. Each
value is either refused by ringctl (a one-line UserError naming the key) or read by sbatch as
exactly the value configured, with no other option changed; where slurmctld takes the job, what
`scontrol show job` reports is compared too. Then the held jobs that sbatch took are released:
the script runs its first commands (`mkdir`, which an injected `BASH_FUNC_mkdir%%` would
replace) and fails for want of a config.yaml, and no marker file may appear.

Only the test cluster's partition `debug`, account `root` and QOS `normal` exist and no node
has features, so slurmctld refuses some values sbatch read correctly (a constraint, a partition
list): that refusal is checked to be slurmctld's own, not an injection effect.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ringctl.config import load_job
from ringctl.errors import UserError
from ringctl.render import render_script

BASH_FUNC = "BASH_FUNC_mkdir%%=() { touch {marker}; }"  # run by bash at the script's `mkdir`
EXPORT = f'--export="ALL,{BASH_FUNC}"'
# After shlex.quote, `\'"` leaves sbatch's reading of the quoted value unquoted (the backslash
# escapes the quote that bash would take for the end of the quoted text), so the space after it
# starts a new option; the final `#` hides the closing quote. It ran code before ringctl 0.2.
BREAK_OUT = "\\'\""
SBATCH_TIMEOUT_S = 30


@dataclass
class Case:
    id: str
    patch: dict  # merged into the base job (written as YAML, so any string gets through)
    meant: dict | None  # options sbatch must read with exactly these values; None: refused
    job_dir: str | None = None  # a directory name to render with (default: the case id)
    slurmctld_may_refuse: str | None = None  # what slurmctld says when it refuses a good value
    results: dict = field(default_factory=dict)


def extra(*items: str) -> dict:
    return {"slurm": {"extra_sbatch": list(items)}}


CORPUS = [
    # name -> --job-name
    Case("name-export", {"name": f"x{BREAK_OUT} {EXPORT} #"}, None),
    Case("name-partition", {"name": f"x{BREAK_OUT} --partition=evil #"}, None),
    Case("name-backslash", {"name": "a\\b"}, None),
    Case("name-hash", {"name": "run#1"}, None),
    Case("name-newline", {"name": "abc\n"}, None),
    Case("name-command", {"name": "$(touch {marker})"}, None),
    Case("name-colon", {"name": ":x"}, None),
    Case("name-words", {"name": "a --partition=evil"}, {"job-name": "a --partition=evil"}),
    Case("name-hetjob", {"name": "hetjob"}, {"job-name": "hetjob"}),
    # slurm.account -> --account
    Case("account-export", {"slurm": {"account": f"root{BREAK_OUT} {EXPORT} #"}}, None),
    Case("account-words", {"slurm": {"account": "root --qos=evil"}}, None),
    Case("account-plain", {"slurm": {"account": "root"}}, {"account": "root"}),
    Case("account-chars", {"slurm": {"account": "proj-1.a_b"}}, {"account": "proj-1.a_b"}),
    # slurm.partition -> --partition
    Case(
        "partition-override", {"slurm": {"partition": f"debug{BREAK_OUT} --partition=evil #"}}, None
    ),
    Case("partition-words", {"slurm": {"partition": "debug --export=ALL"}}, None),
    Case("partition-command", {"slurm": {"partition": "$(id)"}}, None),
    Case("partition-list", {"slurm": {"partition": "debug,debug"}}, {"partition": "debug,debug"}),
    # slurm.qos -> --qos
    Case("qos-export", {"slurm": {"qos": f"normal{BREAK_OUT} {EXPORT} #"}}, None),
    Case("qos-plain", {"slurm": {"qos": "normal"}}, {"qos": "normal"}),
    # slurm.constraint -> --constraint
    Case("constraint-export", {"slurm": {"constraint": f"x{BREAK_OUT} {EXPORT} #"}}, None),
    Case("constraint-space", {"slurm": {"constraint": "a b"}}, None),
    Case(
        "constraint-expr",
        {"slurm": {"constraint": "a&(b|c)"}},
        {"constraint": "a&(b|c)"},
        slurmctld_may_refuse="Invalid feature specification",
    ),
    # other header keys
    Case("time-20-digits", {"slurm": {"time": "12345678901234567890"}}, None),
    Case("time-words", {"slurm": {"time": "5 --partition=evil"}}, None),
    Case("signal-kill", {"slurm": {"signal": "KILL"}}, None),
    Case("signal-zero", {"slurm": {"signal": "USR1@0"}}, None),
    Case("signal-words", {"slurm": {"signal": "USR1@30 --export=ALL"}}, None),
    Case("mem-words", {"slurm": {"mem": "1G --export=ALL"}}, None),
    Case("switches-words", {"slurm": {"switches": "1 --export=ALL"}}, None),
    # --comment (through extra_sbatch)
    Case("comment-export", extra(f"--comment=a{BREAK_OUT} {EXPORT} #"), None),
    Case("comment-unbalanced", extra('--comment="unbalanced'), None),
    Case(
        "comment-hash",
        extra("--comment=hello world # no comment"),
        {"comment": "hello world # no comment"},
    ),
    Case(
        "comment-command",
        extra("--comment=$(touch {marker}) `id`"),
        {"comment": "$(touch {marker}) `id`"},
    ),
    Case("comment-quoted", extra('--comment="two words"'), {"comment": "two words"}),
    # extra_sbatch options
    Case("extra-export", extra(f"--export=ALL,{BASH_FUNC}"), None),
    Case("extra-partition", extra("--partition=evil"), None),
    Case("extra-abbreviated", extra("--part=evil"), None),
    Case("extra-short", extra("-p evil"), None),
    Case("extra-two-options", extra("--mail-type=END --partition=evil"), None),
    Case("extra-wrap", extra("--wrap=touch {marker}"), None),
    Case("extra-chdir", extra("--chdir=/"), None),
    Case("extra-output", extra("--output=/tmp/x"), None),
    Case("extra-space-form", extra("--mail-type END"), {"mail-type": "END"}),
    Case("extra-list", extra("--mail-type=END,FAIL"), {"mail-type": "END,FAIL"}),
    # the job directory -> --chdir, --output (a filename pattern: % is Slurm's)
    Case("dir-percent", {}, {}, job_dir="out%j%%x%N d"),
    Case("dir-quote", {}, {}, job_dir="it's"),
    Case("dir-backslash", {}, None, job_dir="a\\b"),
]


def base_job(partition: str) -> dict:
    return {
        "name": "inj",
        "backend": "slurm",
        "nodes": 1,
        "tasks_per_node": 1,
        "slurm": {"partition": partition, "time": "00:05:00", "signal": "USR1@30"},
    }


def merged(base: dict, patch: dict) -> dict:
    out = dict(base)
    for key, value in patch.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def expected_options(case: Case, job_dir: Path, partition: str, marker: Path) -> dict[str, str]:
    """What sbatch must read: the base job's options, the case's, and the command line's."""
    want = {
        "job-name": "inj",
        "nodes": "1",
        "ntasks-per-node": "1",
        "partition": partition,
        "time": "00:05:00",
        "signal": "USR1@30",
        "chdir": str(job_dir),
        # Slurm's filename pattern: %% is a literal %, the log name keeps its own %j
        "output": str(job_dir).replace("%", "%%") + "/logs/batch-%j.out",
        "hold": "set",
        "parsable": "set",
        "verbose": "1",
        "no-requeue": "no-requeue",  # said always: the cluster's default requeues
        "open-mode": "a",
    }
    want.update(with_marker(case.meant or {}, marker))
    return want


_DEFINED = re.compile(r"^sbatch: ([a-z][a-z0-9-]*) +: (.*)$")


def defined_options(stderr: str) -> dict[str, str] | None:
    """The options sbatch -v says it parsed; None when it printed none (it exited before)."""
    if "sbatch: defined options" not in stderr:
        return None
    block = stderr.split("sbatch: defined options", 1)[1].split("end of defined options", 1)[0]
    return dict(m.groups() for line in block.splitlines() if (m := _DEFINED.match(line)))


def scontrol_fields(job_id: str) -> dict[str, str]:
    """The fields compared, cut out of `scontrol show job -o` by the field that follows each
    (values may hold spaces)."""
    text = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    ).stdout

    def between(key: str, nxt: str) -> str | None:
        m = re.search(rf"(?:^| ){key}=(.*?) (?:{nxt})=", text)
        return m.group(1).rstrip(" ") if m else None

    return {
        "job-name": between("JobName", "UserId"),
        "partition": between("Partition", "AllocNode:Sid"),
        "account": between("Account", "QOS"),
        "qos": between("QOS", "JobState"),
        "chdir": between("WorkDir", "Comment|StdErr"),
        "comment": between("Comment", "StdErr"),
        "mail-type": (re.search(r" MailType=(\S+)", text) or [None, None])[1],
    }


def with_marker(value, marker: Path):
    """The case's values with `{marker}` replaced by the marker file's path."""
    if isinstance(value, dict):
        return {k: with_marker(v, marker) for k, v in value.items()}
    if isinstance(value, list):
        return [with_marker(v, marker) for v in value]
    return value.replace("{marker}", str(marker)) if isinstance(value, str) else value


def run_case(case: Case, root: Path, partition: str, marker: Path, submitted: list[str]) -> str:
    """Load, render, submit held; the outcome in words ("refused: ...", "equal", or what
    differs). Raises nothing for a difference: the table shows every case."""
    patch = with_marker(case.patch, marker)
    job_dir = root / (case.job_dir or case.id)
    job_dir.mkdir(parents=True)
    (job_dir / "logs").mkdir()
    job_file = root / f"{case.id}.yaml"
    job_file.write_text(json.dumps(merged(base_job(partition), patch)))  # JSON is YAML
    try:
        script = render_script(load_job(job_file), job_dir=str(job_dir))
    except UserError as err:
        lines = str(err).splitlines()
        return f"refused: {lines[0]}" if len(lines) == 1 else f"refused in {len(lines)} lines"
    except Exception as err:  # a traceback for the user: not a refusal
        return f"CRASHED: {type(err).__name__}: {err}"
    (job_dir / "job.sh").write_text(script)
    proc = subprocess.run(
        ["sbatch", "--hold", "--parsable", "-v", "job.sh"],
        cwd=job_dir,
        capture_output=True,
        text=True,
        timeout=SBATCH_TIMEOUT_S,
        env=dict(os.environ),
    )
    job_id = proc.stdout.strip().split(";")[0] if proc.returncode == 0 else ""
    if job_id:
        submitted.append(job_id)
        case.results["job_id"] = job_id
    read = defined_options(proc.stderr)
    if read is None:
        return f"DIFFERENT: sbatch read no options: {' '.join(proc.stderr.split())[:200]}"
    want = expected_options(case, job_dir, partition, marker)
    if read != want:
        diff = {
            k: (want.get(k), read.get(k))
            for k in sorted({*want, *read})
            if want.get(k) != read.get(k)
        }
        return f"DIFFERENT (configured, sbatch read): {diff}"
    if not job_id:
        why = " ".join(proc.stderr.split("end of defined options", 1)[1].split())
        if case.slurmctld_may_refuse and case.slurmctld_may_refuse in why:
            return f"equal (sbatch read it; slurmctld: {case.slurmctld_may_refuse})"
        return f"DIFFERENT: sbatch refused: {why[-200:]}"
    shown = scontrol_fields(job_id)
    for key, value in want.items():
        if key in shown and key not in ("account", "qos") and shown[key] != value:
            return f"DIFFERENT in scontrol: {key} = {shown[key]!r}, configured {value!r}"
    if case.meant and "account" in case.meant and case.meant["account"] == "root":
        if shown["account"] != "root":
            return f"DIFFERENT in scontrol: account = {shown['account']!r}"
    return "equal (sbatch and scontrol)"


def wait_finished(job_ids: list[str], timeout: float = 60) -> dict[str, str]:
    """Final states of released jobs, polled with squeue (the cluster keeps them 300 s)."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i %T"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        active = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")
        if len(states) == len(job_ids) and not any(s in active for s in states.values()):
            return states
        time.sleep(0.5)
    pytest.fail(f"released jobs did not finish within {timeout}s: {states}")


def test_hostile_header_values_on_the_real_sbatch(slurm_cluster, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    submitted: list[str] = []
    outcomes: dict[str, str] = {}
    try:
        for case in CORPUS:
            outcomes[case.id] = run_case(case, tmp_path, slurm_cluster.partition, marker, submitted)
        if submitted:
            subprocess.run(["scontrol", "release", *submitted], check=True, timeout=30)
            states = wait_finished(submitted)
        else:
            states = {}
    finally:
        if submitted:
            subprocess.run(["scancel", *submitted], capture_output=True, timeout=30)
    with capsys.disabled():
        print("\n| case | value | outcome |\n|---|---|---|")
        for case in CORPUS:
            shown = json.dumps(case.patch or {"job_dir": case.job_dir})
            outcome = outcomes[case.id].replace(str(tmp_path), "<tmp>")
            print(f"| {case.id} | `{shown}` | {outcome} |")
    assert not marker.exists(), "a hostile value ran code in the job"
    wrong = {
        c.id: outcomes[c.id]
        for c in CORPUS
        if (c.meant is None) != outcomes[c.id].startswith("refused")
    }
    wrong.update({k: v for k, v in outcomes.items() if not v.startswith(("refused", "equal"))})
    assert not wrong, wrong
    for case in CORPUS:  # each job sbatch took ran, and wrote its log where it was told
        job_id = case.results.get("job_id")
        if job_id:
            log = tmp_path / (case.job_dir or case.id) / "logs" / f"batch-{job_id}.out"
            assert log.is_file(), (case.id, states.get(job_id), sorted(log.parent.iterdir()))
            assert "no config.yaml" in log.read_text(), log.read_text()


def test_a_percent_in_the_job_directory_reaches_the_batch_log(slurm_cluster, tmp_path):
    """The backends pass --chdir/--output on sbatch's command line: `batch_log_arguments` doubles
    a `%` of the directory, so the log lands in the directory as named, not in `out<jobid>`."""
    from ringctl.sbatch import batch_log_arguments

    job_dir = tmp_path / "runs%j" / "job%x%%1"
    (job_dir / "logs").mkdir(parents=True)
    cfg = load_job(json_job(tmp_path, base_job(slurm_cluster.partition)))
    (job_dir / "job.sh").write_text(render_script(cfg))
    argv = ["sbatch", "--parsable", *batch_log_arguments(str(job_dir)), str(job_dir / "job.sh")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    try:
        wait_finished([job_id])
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    log = job_dir / "logs" / f"batch-{job_id}.out"
    assert log.is_file(), sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert f"no config.yaml in {job_dir}" in log.read_text()


def json_job(root: Path, data: dict, name: str = "job.yaml") -> Path:
    path = root / name
    path.write_text(json.dumps(data))  # JSON is YAML
    return path


# --- without the cluster: the port of sbatch's header reader, and what it is used for ----------


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("#SBATCH --a=1 --b=2", ["--a=1", "--b=2"]),
        ("#SBATCH --a='x y' --b=\"p q\"", ["--a=x y", "--b=p q"]),
        ("#SBATCH --a='x\\'y'", ["--a=x'y"]),  # a backslash escapes inside single quotes
        ("#SBATCH --a=a\\b", ["--a=ab"]),
        ("#SBATCH --a=x # --b=2", ["--a=x"]),  # an unquoted # ends the line
        ("#SBATCH --a='x # y'", ["--a=x # y"]),
        ("#SBATCH", []),
    ],
)
def test_header_words_reads_like_sbatch(line, words):
    from ringctl.sbatch import header_words

    assert header_words(line) == words


@pytest.mark.parametrize("line", ["#SBATCH --a='x", '#SBATCH --a="x', "#SBATCH :x"])
def test_header_words_refuses_what_sbatch_exits_on(line):
    from ringctl.sbatch import header_words

    with pytest.raises(ValueError):
        header_words(line)


def test_header_lines_are_read_back_as_configured(tmp_path):
    """Every accepted value of the corpus, and a few more, reads back through the port as one
    `--option=value` word holding exactly the configured text."""
    from ringctl.sbatch import header_words

    patch = {
        "name": "a b+c:d@e,f=g-h.i_j",
        "slurm": {
            "account": "proj-1.a_b",
            "partition": "gpu,debug",
            "qos": "high",
            "constraint": "[a*2&b]|(c,d)!e",
            "mem": "64G",
            "cpus_per_task": 8,
            "switches": "1@00:10:00",
            "extra_sbatch": ["--comment=a # b $(c) `d` %j", "--mail-type END", "--contiguous"],
        },
    }
    cfg = load_job(json_job(tmp_path, merged(base_job("debug"), patch)))
    job_dir = "/scratch/it's a dir%j"
    script = render_script(cfg, job_dir=job_dir)
    read = [w for ln in script.splitlines() if ln.startswith("#SBATCH") for w in header_words(ln)]
    assert read == [
        "--job-name=a b+c:d@e,f=g-h.i_j",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=8",
        "--mem=64G",
        "--partition=gpu,debug",
        "--account=proj-1.a_b",
        "--qos=high",
        "--time=00:05:00",
        "--constraint=[a*2&b]|(c,d)!e",
        "--switches=1@00:10:00",
        "--signal=USR1@30",
        "--no-requeue",
        "--open-mode=append",
        "--chdir=/scratch/it's a dir%j",
        "--output=/scratch/it's a dir%%j/logs/batch-%j.out",
        "--comment=a # b $(c) `d` %j",
        "--mail-type=END",
        "--contiguous",
    ]


def test_a_config_that_skipped_load_job_is_still_checked(tmp_path):
    """render_script checks the header values itself (a config built another way, e.g. an
    edited config.yaml read without ringctl's loader)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(
        load_job(json_job(tmp_path, base_job("debug"))), {"slurm": {"partition": "a b"}}
    )
    with pytest.raises(UserError, match=r"^slurm\.partition: 'a b' is not a partition name"):
        render_script(cfg)
