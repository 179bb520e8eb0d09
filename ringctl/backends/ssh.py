"""The `ssh` backend: the `slurm` backend run on a remote login node through paramiko.

- submit: the job directory is copied by SFTP to `<remote_dir>/<job dir name>` on the login node
  (a relative `remote_dir` is under the remote home), then `sbatch` runs there.
- status, logs, cancel: `squeue`/`sacct`/`scancel` and reads of the remote files, over the same
  connection; once the job is finished, its files (logs, plan, probes, outputs) are fetched back
  into the local job directory (`fetch` does it on demand).
- Every remote command is an argv joined with `shlex.join`: no user value reaches the remote
  shell unquoted.
- Authentication by key file or ssh-agent only, never a password. Host keys are checked against
  known_hosts; an unknown host is refused, with the command that trusts it, unless the config
  says `trust_unknown_host` (its key is then added to known_hosts). Connection failures and
  timeouts are one-line `UserError`s.
"""

from __future__ import annotations

import base64
import hashlib
import os
import posixpath
import shlex
import socket
import stat
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import paramiko

from ..errors import UserError
from .base import JobStatus
from .slurm import SlurmBackend, _one_line, read_job_json, update_job_json

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


@dataclass
class SSHSettings:
    """Where and how to log in (the `ssh` section of a job config has the same names)."""

    host: str
    port: int = 22
    user: str | None = None
    key: str | None = None  # private key file; default: the SSH agent and ~/.ssh keys
    known_hosts: str | None = None  # default: ~/.ssh/known_hosts
    remote_dir: str = "ringctl-jobs"  # relative paths are under the remote home
    trust_unknown_host: bool = False
    connect_timeout: float = 15.0
    command_timeout: float = 120.0

    @property
    def target(self) -> str:
        user = f"{self.user}@" if self.user else ""
        return f"{user}{self.host}:{self.port}"

    @property
    def known_hosts_path(self) -> str:
        return os.path.expanduser(self.known_hosts or DEFAULT_KNOWN_HOSTS)


def create(cfg) -> SSHBackend:
    """The backend for a resolved job config: its `ssh` section."""
    s = cfg.ssh
    if not s.host:
        raise UserError("ssh.host: is required with backend=ssh")
    return SSHBackend(
        SSHSettings(
            host=str(s.host),
            port=int(s.port),
            user=s.user,
            key=s.key,
            known_hosts=s.known_hosts,
            remote_dir=str(s.remote_dir),
            trust_unknown_host=bool(s.trust_unknown_host),
            connect_timeout=float(s.connect_timeout),
        )
    )


# -- host keys -------------------------------------------------------------------------------------


def _fingerprint(key: paramiko.PKey) -> str:
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


class _UnknownHost(Exception):
    pass


class _RefuseUnknown(paramiko.MissingHostKeyPolicy):
    """Refuse a host that is not in known_hosts, saying how to trust it."""

    def __init__(self, settings: SSHSettings) -> None:
        self.s = settings

    def missing_host_key(self, client, hostname, key) -> None:
        s = self.s
        port = f"-p {s.port} " if s.port != 22 else ""
        known = s.known_hosts or DEFAULT_KNOWN_HOSTS
        raise _UnknownHost(
            f"ssh {s.target}: host {hostname} is not in {known} (it offers {_fingerprint(key)}); "
            f"if that is the right host, trust it with: "
            f"ssh-keyscan {port}{shlex.quote(s.host)} >> {known}"
            " (or set ssh.trust_unknown_host=true to add it on first connection)"
        )


class _TrustAndRecord(paramiko.MissingHostKeyPolicy):
    """The explicit opt-in: accept an unknown host's key and append it to known_hosts."""

    def __init__(self, settings: SSHSettings) -> None:
        self.s = settings

    def missing_host_key(self, client, hostname, key) -> None:
        path = self.s.known_hosts_path
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


# -- the remote shell ----------------------------------------------------------------------------


class SSHShell:
    """`Shell` (see slurm.py) on a login node: commands by exec, files by SFTP."""

    def __init__(self, client: paramiko.SSHClient, settings: SSHSettings) -> None:
        self.client = client
        self.settings = settings
        self.where = settings.target
        self._sftp: paramiko.SFTPClient | None = None

    @property
    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            try:
                self._sftp = self.client.open_sftp()
            except (paramiko.SSHException, OSError) as err:
                raise UserError(f"ssh {self.where}: SFTP failed: {_one_line(str(err))}") from None
            self._sftp.get_channel().settimeout(self.settings.command_timeout)
        return self._sftp

    def run(self, argv: Sequence[str], *, timeout: float = 60.0) -> tuple[int, str, str]:
        command = shlex.join(argv)
        try:
            transport = self.client.get_transport()
            if transport is None or not transport.is_active():
                raise UserError(f"ssh {self.where}: the connection is closed")
            chan = transport.open_session(timeout=timeout)
            chan.settimeout(timeout)
            chan.exec_command(command)
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + timeout
            while True:
                busy = False
                while chan.recv_ready():
                    out += chan.recv(65536)
                    busy = True
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                    busy = True
                if chan.exit_status_ready() and not chan.recv_ready():
                    if not chan.recv_stderr_ready():
                        break
                if time.monotonic() > deadline:
                    chan.close()
                    raise UserError(
                        f"ssh {self.where}: `{argv[0]}` did not answer within {timeout:.0f}s"
                    )
                if not busy:
                    time.sleep(0.01)
            rc = chan.recv_exit_status()
            chan.close()
        except TimeoutError:
            raise UserError(
                f"ssh {self.where}: `{argv[0]}` did not answer within {timeout:.0f}s"
            ) from None
        except (paramiko.SSHException, OSError) as err:
            raise UserError(
                f"ssh {self.where}: running `{argv[0]}` failed: {_one_line(str(err))}"
            ) from None
        return rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")

    def read_from(self, path: str, offset: int = 0) -> bytes | None:
        try:
            with self.sftp.open(path, "rb") as f:
                if offset:
                    f.seek(offset)
                f.prefetch()
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as err:
            if getattr(err, "errno", None) == 2:
                return None
            raise UserError(f"ssh {self.where}: reading {path}: {_one_line(str(err))}") from None

    def listdir(self, path: str) -> list[str]:
        try:
            return self.sftp.listdir(path)
        except OSError:
            return []

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
            self._sftp = None
        self.client.close()


def connect(settings: SSHSettings) -> paramiko.SSHClient:
    """An SSH connection with checked host key and key/agent authentication, or a UserError."""
    s = settings
    client = paramiko.SSHClient()
    known = s.known_hosts_path
    try:
        if os.path.exists(known):
            client.load_host_keys(known)
        if s.known_hosts is None and os.path.exists("/etc/ssh/ssh_known_hosts"):
            client.load_system_host_keys("/etc/ssh/ssh_known_hosts")
    except (OSError, paramiko.SSHException) as err:
        raise UserError(f"ssh: cannot read known_hosts {known}: {_one_line(str(err))}") from None
    policy = _TrustAndRecord(s) if s.trust_unknown_host else _RefuseUnknown(s)
    client.set_missing_host_key_policy(policy)
    key = os.path.expanduser(s.key) if s.key else None
    if key and not os.path.isfile(key):
        raise UserError(f"ssh.key: no such file {s.key}")
    t = s.connect_timeout
    t0 = time.monotonic()
    try:
        client.connect(
            s.host,
            port=s.port,
            username=s.user,
            key_filename=key,
            password=None,  # never: keys or the agent only
            allow_agent=True,
            look_for_keys=key is None,
            timeout=t,
            banner_timeout=t,
            auth_timeout=t,
            channel_timeout=t,
        )
    except _UnknownHost as err:
        client.close()
        raise UserError(str(err)) from None
    except paramiko.BadHostKeyException as err:
        client.close()
        raise UserError(
            f"ssh {s.target}: the host key ({_fingerprint(err.key)}) does not match the one in "
            f"{known}: the host was reinstalled, or someone is in between; once sure, remove the "
            f"old entry with: ssh-keygen -R {shlex.quote(_known_hosts_name(s))} -f {known}"
        ) from None
    except paramiko.AuthenticationException as err:
        client.close()
        how = f"key {s.key}" if s.key else "the ssh-agent and ~/.ssh keys"
        raise UserError(
            f"ssh {s.target}: authentication failed with {how} ({_one_line(str(err))}); "
            "passwords are not used: set ssh.key or load the key into ssh-agent"
        ) from None
    except TimeoutError:
        client.close()
        raise UserError(f"ssh {s.target}: timed out after {t:g}s connecting") from None
    except socket.gaierror as err:
        client.close()
        raise UserError(f"ssh {s.target}: unknown host name ({err.strerror})") from None
    except paramiko.ssh_exception.NoValidConnectionsError as err:
        client.close()
        reasons = {e.strerror or str(e) for e in err.errors.values()}
        raise UserError(f"ssh {s.target}: cannot connect: {'; '.join(sorted(reasons))}") from None
    except paramiko.SSHException as err:
        client.close()
        text = _one_line(str(err))
        if time.monotonic() - t0 >= 0.9 * t or "banner" in text or "No existing session" in text:
            # paramiko ends a timed-out handshake quietly, then fails on the missing session
            raise UserError(
                f"ssh {s.target}: timed out after {t:g}s waiting for the SSH handshake "
                f"(is port {s.port} an SSH server?)"
            ) from None
        raise UserError(f"ssh {s.target}: {text}") from None
    except OSError as err:
        client.close()
        raise UserError(f"ssh {s.target}: cannot connect: {err.strerror or err}") from None
    return client


def _known_hosts_name(s: SSHSettings) -> str:
    return s.host if s.port == 22 else f"[{s.host}]:{s.port}"


# -- the backend ---------------------------------------------------------------------------------


class SSHBackend(SlurmBackend):
    """`SlurmBackend` whose commands and files are on a login node. Connects on first use;
    `close()` (or `with SSHBackend(...) as b:`) ends the connection."""

    name = "ssh"

    def __init__(self, settings: SSHSettings, **slurm_options) -> None:
        slurm_options.setdefault("command_timeout_s", settings.command_timeout)
        super().__init__(None, **slurm_options)
        self.settings = settings
        self._remote_base: str | None = None

    def __enter__(self) -> SSHBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._shell_obj is not None:
            self._shell_obj.close()
            self._shell_obj = None

    @property
    def shell(self) -> SSHShell:
        if self._shell_obj is None:
            self._shell_obj = SSHShell(connect(self.settings), self.settings)
        return self._shell_obj

    # -- where the job lives on the login node ----------------------------------------------------

    def remote_base(self) -> str:
        if self._remote_base is None:
            base = self.settings.remote_dir
            if base.startswith("~/"):
                base = base[2:]
            elif base == "~":
                base = "."
            if not posixpath.isabs(base):
                try:
                    home = self.shell.sftp.normalize(".")
                except OSError as err:
                    raise UserError(
                        f"ssh {self.settings.target}: no remote home directory ({err})"
                    ) from None
                base = posixpath.join(home, base)
            self._remote_base = posixpath.normpath(base)
        return self._remote_base

    def _cluster_dir(self, job_dir: Path) -> str:
        recorded = read_job_json(Path(job_dir)).get("remote", {}).get("dir")
        return recorded or posixpath.join(self.remote_base(), Path(job_dir).resolve().name)

    def _prepare(self, job_dir: Path) -> str:
        remote = posixpath.join(self.remote_base(), Path(job_dir).resolve().name)
        sftp = self.shell.sftp
        try:
            sftp.stat(remote)
        except FileNotFoundError:
            pass
        else:
            raise UserError(
                f"ssh {self.settings.target}: {remote} already exists on the login node "
                "(a job directory of the same name); remove it or rename the job"
            )
        self._mkdirs(self.remote_base())
        self._upload(Path(job_dir), remote)
        return remote

    def _submitted_fields(self, job_dir: Path, cluster_dir: str) -> dict:
        s = self.settings
        return {"remote": {"host": s.host, "port": s.port, "user": s.user, "dir": cluster_dir}}

    def _after_final(self, job_dir: Path, status: JobStatus) -> None:
        if not read_job_json(Path(job_dir)).get("fetched_at"):
            self.fetch(job_dir)

    # -- SFTP --------------------------------------------------------------------------------------

    def _mkdirs(self, path: str) -> None:
        sftp = self.shell.sftp
        parts = []
        while path not in ("", "/"):
            try:
                sftp.stat(path)
                break
            except FileNotFoundError:
                parts.append(path)
                path = posixpath.dirname(path)
        for p in reversed(parts):
            sftp.mkdir(p, mode=0o755)

    def _upload(self, local: Path, remote: str) -> None:
        sftp = self.shell.sftp
        try:
            sftp.mkdir(remote, mode=0o755)
            for root, dirs, files in os.walk(local):
                rel = os.path.relpath(root, local)
                rdir = remote if rel == "." else posixpath.join(remote, *Path(rel).parts)
                for d in sorted(dirs):
                    sftp.mkdir(posixpath.join(rdir, d), mode=0o755)
                for f in sorted(files):
                    src = os.path.join(root, f)
                    dst = posixpath.join(rdir, f)
                    sftp.put(src, dst)
                    sftp.chmod(dst, stat.S_IMODE(os.stat(src).st_mode))
            if not (local / "logs").is_dir():
                sftp.mkdir(posixpath.join(remote, "logs"), mode=0o755)
        except OSError as err:
            raise UserError(
                f"ssh {self.settings.target}: uploading the job directory to {remote} failed: "
                f"{_one_line(str(err))}"
            ) from None

    def fetch(self, job_dir: Path) -> list[str]:
        """Copy the remote job directory's files back (job.json stays the local one); return
        the relative paths fetched."""
        job_dir = Path(job_dir)
        remote = self._cluster_dir(job_dir)
        sftp = self.shell.sftp
        fetched: list[str] = []

        def walk(rdir: str, ldir: Path) -> Iterator[tuple[str, Path]]:
            for entry in sftp.listdir_attr(rdir):
                rpath = posixpath.join(rdir, entry.filename)
                if stat.S_ISDIR(entry.st_mode or 0):
                    yield from walk(rpath, ldir / entry.filename)
                elif stat.S_ISREG(entry.st_mode or 0):
                    yield rpath, ldir / entry.filename

        try:
            for rpath, lpath in walk(remote, job_dir):
                rel = lpath.relative_to(job_dir).as_posix()
                if rel == "job.json":
                    continue
                lpath.parent.mkdir(parents=True, exist_ok=True)
                tmp = lpath.with_name(f".{lpath.name}.part")
                sftp.get(rpath, str(tmp))
                tmp.replace(lpath)
                fetched.append(rel)
        except OSError as err:
            raise UserError(
                f"ssh {self.settings.target}: fetching {remote} failed: {_one_line(str(err))}"
            ) from None
        update_job_json(
            job_dir, fetched_at=datetime.now(timezone.utc).isoformat(timespec="seconds")
        )
        return fetched

    def logs(
        self, job_dir: Path, *, rank: int | None = None, follow: bool = False
    ) -> Iterator[str]:
        yield from super().logs(job_dir, rank=rank, follow=follow)
        if follow:
            self.fetch(job_dir)
