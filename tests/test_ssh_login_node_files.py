"""An SSH job's paths name the login node's files, not this machine's.

Over ssh the ranks read ``task.inputs``, ``task.model_path`` and ``task.tokenizer_path`` on the
cluster, and the machine that submits (a laptop) may have none of them, or other files at the
same paths. Submit checked and sized them here: a job whose data lives only on the cluster was
refused ("does not exist"), and a relative path was made absolute against this machine's working
directory. Now such paths must be absolute, submit looks for them on the login node over SFTP
(``SSHBackend.check_named_files``), and reads none of them here.

The end-to-end test hides the data from the submitting process only: it runs `ringctl submit`
in a mount namespace of its own (``unshare --mount``) with an empty tmpfs over the data folder,
while the loopback sshd (the login node) and the Slurm nodes see the real files.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from ringctl.backends.base import JobState
from ringctl.config import load_job
from ringctl.errors import UserError
from ringctl.submission import checked_for_submission, open_job_dir
from tests.local_jobs import ssh_overrides, submitted_job_dir, wait_for

LONGDOC = "jobs/longdoc.yaml"
TEXT = "A document that lives on the cluster only.\n"


def _ssh(login, remote: Path) -> list[str]:
    return [*ssh_overrides(login), f"ssh.remote_dir={remote}"]


LOGIN = ["backend=ssh", "ssh.host=login.example.org"]  # never connected to by load_job


@pytest.mark.parametrize("key", ["task.inputs=[docs/a.txt]", "task.model_path=models/m"])
def test_a_relative_path_over_ssh_is_refused_by_name(key: str) -> None:
    """It was made absolute against this machine's working directory (or refused as missing
    here), a path the login node may not have."""
    with pytest.raises(UserError) as err:
        load_job(LONGDOC, [*LOGIN, key])
    name = key.split("=")[0]
    assert f"{name}:" in str(err.value) and "is not absolute" in str(err.value)
    assert "login node" in str(err.value) and "\n" not in str(err.value)


def test_an_ssh_job_s_paths_are_neither_read_nor_sized_here(tmp_path: Path) -> None:
    """Paths this machine does not have pass the config's checks and submit's sizing (they
    are looked for on the login node); a budget the planner would derive from the model's
    config.json is refused naming why."""
    gone = tmp_path / "not-here"
    paths = [f"task.inputs=[{gone}/a.txt]", f"task.model_path={gone}/model"]
    cfg = checked_for_submission(load_job(LONGDOC, [*LOGIN, *paths]), LONGDOC)
    assert list(cfg.task.inputs) == [f"{gone}/a.txt"] and cfg.task.model_path == f"{gone}/model"
    auto = ["ring.size=auto", "device=H100-SXM"]
    with pytest.raises(UserError, match=r"model_path: .* is on the login node \(backend=ssh\)"):
        checked_for_submission(load_job(LONGDOC, [*LOGIN, *paths, *auto]), LONGDOC)


@pytest.mark.ssh
def test_a_path_missing_on_the_login_node_is_refused_before_anything_is_made(
    ssh_login, tmp_path: Path, capsys
) -> None:
    from ringctl.cli import main

    present = tmp_path / "a.txt"
    present.write_text(TEXT)
    out, base = tmp_path / "jobs", _ssh(ssh_login, tmp_path / "login")
    cases = {
        f"task.model_path={tmp_path}/no-model": f"task.model_path: {tmp_path}/no-model does not",
        f"task.inputs=[{tmp_path}/x.txt,{tmp_path}/y.txt]": "task.inputs: none of them exists",
    }
    for override, said in cases.items():
        capsys.readouterr()
        assert main(["submit", LONGDOC, *base, f"output_dir={out}", override]) == 2
        err = capsys.readouterr().err
        assert said in err and f"the login node {ssh_login.user}@{ssh_login.host}" in err, err
        assert not out.exists() and not (tmp_path / "login").exists()


@pytest.mark.slurm
@pytest.mark.ssh
def test_an_ssh_job_reads_its_model_and_documents_on_the_cluster(
    slurm_cluster, ssh_login, tmp_path: Path
) -> None:
    """Submitted from a process that cannot see the data (an empty tmpfs over it), the job
    runs on the files the login node has; each token's log-probability equals one process's."""
    from safetensors.torch import load_file

    from ringctl.cli import main
    from ringctl.longdoc.model.load import load_model
    from ringctl.longdoc.model.tokenize import ByteTokenizer

    data = tmp_path / "cluster-data"
    model = data / "model"
    shutil.copytree(resources.files("ringctl.longdoc") / "data" / "demo-byte-llama", model)
    (data / "a.txt").write_text(TEXT)
    argv = [
        *("submit", LONGDOC, f"output_dir={tmp_path / 'jobs'}", "nodes=2", "tasks_per_node=1"),
        *(f"task.inputs=[{data / 'a.txt'}]", f"task.model_path={model}"),
        *(f"slurm.partition={slurm_cluster.partition}", *_ssh(ssh_login, tmp_path / "login")),
    ]
    hide = 'mount -t tmpfs none "$1" && shift && exec "$@"'
    done = subprocess.run(
        ["unshare", "--mount", "--", "sh", "-c", hide, "sh", str(data)]
        + [sys.executable, "-m", "ringctl", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    job = submitted_job_dir(done.stdout)
    _, _, backend = open_job_dir(job)
    status = wait_for(lambda: (s := backend.status(job)).state.finished and s, 240, "the end")
    assert status.state is JobState.COMPLETED, status
    assert main(["gather", str(job)]) == 0
    [doc] = sorted((job / "gathered" / "docs").glob("*.safetensors"))
    got = load_file(str(doc))
    ids = ByteTokenizer().encode(TEXT.encode()).long()
    assert torch.equal(got["input_ids"].long(), ids)
    with torch.no_grad():
        logits = load_model(str(model), attn_implementation="sdpa")(input_ids=ids[None]).logits
    want = logits[0].double().log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]
    err = (got["token_logprob"].double() - want).abs().max() / want.abs().max()
    assert err < 1e-5, f"relative error {err:.2e}"


@pytest.mark.parametrize("backend", ["local", "ssh"])
def test_gather_of_an_ssh_training_job_says_where_its_tokenizer_is(backend, tmp_path: Path):
    """Its tokenizer is the login node's: gather here refused it as "not found now" with no
    way on; it says to gather on the login node or copy it to the same path here."""
    from omegaconf import OmegaConf

    from ringctl.train.checkpoint import Checkpoint
    from ringctl.train.export import LOGIN_NODE_TOKENIZER, run_tokenizer_dir

    tokenizer = str(tmp_path / "on-the-cluster" / "tokenizer")
    run = Checkpoint(tmp_path, 1, {"run": {"tokenizer_path": tokenizer, "byte_tokens": False}})
    job = {"backend": backend, "task": {"tokenizer_path": tokenizer, "model_path": None}}
    with pytest.raises(UserError, match="the run trained with a tokenizer") as err:
        run_tokenizer_dir(OmegaConf.create(job), run)
    assert (LOGIN_NODE_TOKENIZER in str(err.value)) == (backend == "ssh")
