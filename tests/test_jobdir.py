"""The job directory's lifecycle: atomic creation, what a failed submit leaves, the lock,
attempt numbering, stale temporary files, and one-line errors for impossible places."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ringctl.cli import main
from ringctl.errors import UserError
from ringctl.jobdir import JobDir

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "jobs" / "smoke.yaml")


def test_create_is_atomic_and_complete(tmp_path):
    job = JobDir.create(
        {"config.yaml": "name: a\n", "job.sh": "#!/bin/bash\n"},
        target=None,
        base=tmp_path,
        stem="a",
    )
    assert job.path == tmp_path / "a"
    assert job.config.read_text() == "name: a\n" and job.script.stat().st_mode & 0o111
    assert all((job.path / d).is_dir() for d in ("logs", "probes", "out"))
    again = JobDir.create({"config.yaml": "x"}, target=None, base=tmp_path, stem="a")
    assert again.path == tmp_path / "a-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a-2"]  # no temporary left


def test_a_failed_creation_leaves_nothing(tmp_path):
    with pytest.raises(TypeError):
        JobDir.create(
            {"config.yaml": "ok", "job.sh": object()}, target=None, base=tmp_path, stem="b"
        )
    assert list(tmp_path.iterdir()) == []


def test_a_refused_submit_leaves_no_directory(tmp_path, capsys):
    # sbatch is refused (no such partition on a machine without Slurm, or on the test cluster)
    code = main(
        ["submit", SMOKE, f"output_dir={tmp_path}", "backend=slurm", "slurm.partition=nosuch"]
    )
    assert code != 0
    assert list(tmp_path.iterdir()) == [], "a failed submit left a directory behind"


def test_job_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["submit", SMOKE, f"job_dir={tmp_path / 'f'}"]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a directory" in err and err.count("\n") == 1


def test_lock_refuses_a_second_holder(tmp_path):
    job = JobDir(tmp_path)
    with job.lock("resume"):
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from ringctl.jobdir import JobDir\n"
                "try:\n  with JobDir(sys.argv[1]).lock('cancel'): print('got it')\n"
                "except Exception as e: print('refused:', e)",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        assert child.stdout.startswith("refused:") and "ringctl resume" in child.stdout
    with job.lock("cancel"):  # released: free again
        pass


def test_attempts_are_numbered_by_the_highest(tmp_path):
    job = JobDir(tmp_path)
    (tmp_path / "logs").mkdir()
    assert job.archive_attempt().name == "1"
    assert job.archive_attempt().name == "2"
    shutil.rmtree(tmp_path / "attempts" / "1")  # a user deleted an old attempt
    assert job.archive_attempt().name == "3"


def test_stale_temporaries_are_removed(tmp_path):
    job = JobDir(tmp_path)
    (tmp_path / "out" / "longdoc").mkdir(parents=True)
    stale = tmp_path / "out" / "longdoc" / ".doc.safetensors.abc123.tmp"
    stale.write_bytes(b"half")
    keep = tmp_path / "out" / "longdoc" / "doc.safetensors"
    keep.write_bytes(b"whole")
    assert job.remove_stale_temporaries() == [stale]
    assert keep.exists() and not stale.exists()


def test_meta_damage_is_one_line(tmp_path):
    (tmp_path / "job.json").write_text("{broken")
    with pytest.raises(UserError, match="job.json: not valid JSON"):
        JobDir(tmp_path).read_meta()
    (tmp_path / "job.json").write_text("[1]")
    with pytest.raises(UserError, match="expected a JSON object"):
        JobDir(tmp_path).read_meta()


def test_deprecated_ring_plan_key_is_read_as_placement(tmp_path, capsys):
    from ringctl.config import load_job

    cfg = load_job(SMOKE, ["ring.plan=skip"])
    assert cfg.ring.placement.value == "skip"
    assert "ring.plan is deprecated, read as ring.placement" in capsys.readouterr().err


def test_missing_optional_package_is_refused_before_anything_is_created(tmp_path):
    """transformers blocked in this interpreter: `ringctl run longdoc` refuses with the
    install line, and creates nothing."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from ringctl.cli import main\n"
        f"sys.exit(main(['run', 'longdoc', 'output_dir={tmp_path}', "
        "'task.model_path=bundled:demo-byte-llama']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "needs transformers" in proc.stderr and "pip install 'ringctl[hf]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_bundled_job_by_name_and_example(tmp_path, capsys):
    assert main(["config", "smoke"]) == 0
    assert "name: smoke" in capsys.readouterr().out
    assert main(["example", "longdoc", str(tmp_path)]) == 0
    assert (tmp_path / "longdoc.yaml").read_text() == (ROOT / "jobs" / "longdoc.yaml").read_text()
    assert main(["example", "longdoc", str(tmp_path)]) == 2  # no silent overwrite
    assert main(["config", "nosuchjob"]) == 2
    assert "bundled jobs, usable by name: attention, longdoc, smoke" in capsys.readouterr().err
