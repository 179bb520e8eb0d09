"""The `ssh` backend: the `slurm` backend run on a remote login node through paramiko.

- submit: the job directory is copied by SFTP to `<remote_dir>/<job dir name>` on the login node
  (a relative `remote_dir` is under the remote home), then `sbatch` runs there.
- status, logs, cancel: `squeue`/`sacct`/`scancel` and reads of the remote files, over the same
  connection; nothing is copied back by them.
- fetch (`ringctl gather`): the task's outputs (`out/`), the logs, the probes, the placement
  and earlier attempts' logs (`attempts/`) come back into their own places. The remote
  directory is not trusted: control files (config.yaml, job.json, state.json, the script,
  keys, known_hosts) are never replaced, every name is checked (one path component, UTF-8, no
  dot files, short enough) and every local path must resolve inside the local job directory;
  no symlink is followed (a fetched folder or placement.json that is one is skipped too); a
  name that fails, or a file that went away meanwhile, is skipped with a warning.
- Every remote command is an argv joined with `shlex.join`: no user value reaches the remote
  shell unquoted.
- Authentication by key file or ssh-agent only, never a password. Host keys are checked against
  known_hosts (a key marked @revoked in any file OpenSSH reads by default is refused); an
  unknown host is refused, with the command that trusts it, unless the config says
  `trust_unknown_host` (its key is then added to known_hosts). Connection failures and
  timeouts are one-line `UserError`s.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import posixpath
import secrets
import shlex
import shutil
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import paramiko
from omegaconf import OmegaConf
from paramiko import sftp as sftp_proto
from paramiko.sftp_attr import SFTPAttributes

from ..bounded_read import read_window
from ..errors import NotSubmitted, RemoteGone, UserError
from ..jobdir import (
    ARCHIVED_ON_RESUME,
    ATTEMPTS,
    CHECKPOINTS,
    DCP_METADATA,
    FETCHED_DIRS,
    LOGS,
    PLACEMENT,
    RESENT_ON_RESUME,
    JobDir,
    attempt_name,
)
from ..sbatch import path_problem
from ..tasks.base import NamedFile
from ..text import cut, echo
from ..train.checkpoint import LATEST, STEP_NAME, checkpoint_step, step_name
from . import listing
from .base import JobState, JobStatus
from .shell import READ_LIMIT
from .slurm import SlurmBackend, expected_ranks, one_line
from .ssh_config import DEFAULT_KNOWN_HOSTS, SshConfig

# One schema for SSH settings: the `ssh` section of a job config (ssh_config.SshConfig).
SSHSettings = SshConfig

# paramiko logs a transport thread's failure (a login node closing a new connection: "Error
# reading SSH protocol banner") as a traceback through logging's last resort, ~20 lines ahead
# of ringctl's own one-line reason. Its exceptions reach ringctl, which says them.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


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
        known = s.known_hosts_path  # expanded: a quoted ~ is no home to the shell
        raise _UnknownHost(
            f"ssh {s.target}: host {hostname} is not in {known} (it offers {_fingerprint(key)}); "
            f"if that is the right host, trust it with: "
            f"ssh-keyscan {port}{shlex.quote(s.host)} >> {shlex.quote(str(known))}"
            " (or set ssh.trust_unknown_host=true to add it on first connection)"
        )


class _TrustAndRecord(paramiko.MissingHostKeyPolicy):
    """The explicit opt-in: accept an unknown host's key and append it to known_hosts."""

    def __init__(self, settings: SSHSettings) -> None:
        self.s = settings

    def missing_host_key(self, client, hostname, key) -> None:
        path = self.s.known_hosts_path
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        with open(path, "a+b") as f:
            f.write(_line_start(f) + f"{hostname} {key.get_name()} {key.get_base64()}\n".encode())
        client.get_host_keys().add(hostname, key.get_name(), key)


def _line_start(f) -> bytes:
    """A newline when the file (open for appending) does not end with one: the new entry was
    glued onto the last line, and the host pinned there lost its key."""
    if f.seek(0, os.SEEK_END) == 0:
        return b""
    f.seek(-1, os.SEEK_END)
    return b"" if f.read(1) == b"\n" else b"\n"


class _RevokedHost(_UnknownHost):
    pass


# The other known_hosts files OpenSSH reads by default: the user's own two (UserKnownHostsFile:
# ~/.ssh/known_hosts, read here too when ssh.known_hosts names another file, and
# ~/.ssh/known_hosts2) and the system-wide ones (GlobalKnownHostsFile). Their `@revoked` keys
# always apply, their plain keys only when ssh.known_hosts is left at its default.
USER_KNOWN_HOSTS2 = "~/.ssh/known_hosts2"
SYSTEM_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")


class _RefuseRevoked(paramiko.MissingHostKeyPolicy):
    """A key marked @revoked in any known_hosts file read is refused, whatever the other policy
    says. Revoked keys are kept out of the client's known keys (`KnownHosts.install`), so
    paramiko asks this policy about them even where a file also lists them plainly."""

    def __init__(self, revoked: dict[tuple[str, str], str], then: paramiko.MissingHostKeyPolicy):
        self.revoked, self.then = revoked, then

    def missing_host_key(self, client, hostname, key) -> None:
        where = self.revoked.get((key.get_name(), key.get_base64()))
        if where is not None:
            raise _RevokedHost(
                f"ssh {hostname}: its host key {_fingerprint(key)} is marked @revoked in "
                f"{where}: refusing to connect (REVOKED HOST KEY)"
            )
        self.then.missing_host_key(client, hostname, key)


class KnownHosts:
    """Plain entries and @revoked keys of the known_hosts files read, kept apart so that a
    revoked key is refused wherever else it is listed (as OpenSSH does: "REVOKED HOST KEY
    DETECTED"): an admin revokes in the system file while ~/.ssh/known_hosts still lists it."""

    def __init__(self) -> None:
        self.entries: list[tuple[list[str], paramiko.PKey]] = []
        self.revoked: dict[tuple[str, str], str] = {}  # (type, base64) -> the file revoking it

    def read(self, path: str, *, plain: bool = True) -> None:
        """Add a file's @revoked keys, and its plain entries unless `plain` is False."""
        entries, revoked = read_known_hosts(path)
        for key in revoked:
            self.revoked.setdefault(key, path)
        if plain:
            self.entries += entries

    def install(self, keys: paramiko.HostKeys) -> None:
        """Put the plain entries whose key is not revoked into paramiko's known keys."""
        for names, key in self.entries:
            if (key.get_name(), key.get_base64()) in self.revoked:
                continue
            for name in names:
                keys.add(name, key.get_name(), key)


def read_known_hosts(path: str) -> tuple[list[tuple[list[str], paramiko.PKey]], set]:
    """A known_hosts file's plain entries (host patterns, key) and its @revoked keys.

    paramiko's own loader fails on marker lines, which sites with host certificates have
    (OpenSSH's sshd(8) "SSH_KNOWN_HOSTS FILE FORMAT"). `@revoked` keys are returned (as
    (type, base64), whatever host pattern the line names) so they are refused;
    `@cert-authority` lines are skipped with a note (certificates are not checked here: such
    hosts need their plain key listed too)."""
    revoked: set[tuple[str, str]] = set()
    entries: list[tuple[list[str], paramiko.PKey]] = []
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError as err:
        raise UserError(f"ssh: cannot read known_hosts {path}: {err.strerror}") from None
    noted = False
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("@"):
            marker, _, rest = text.partition(" ")
            fields = rest.split()
            if marker == "@revoked" and len(fields) >= 3:
                revoked.add((fields[1], fields[2]))
            elif not noted:
                print(
                    f"ringctl: note: {path}:{number}: {marker} lines are not used by ringctl "
                    "(host certificates are not checked; list the host's key itself)",
                    file=sys.stderr,
                )
                noted = True
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(text, number)
        except (
            paramiko.SSHException,
            paramiko.hostkeys.InvalidHostKey,  # a key that does not decode: not an SSHException
            ValueError,
            TypeError,
            binascii.Error,
        ):
            entry = None
        if entry is None or entry.key is None:
            continue  # an unreadable line is skipped, as OpenSSH does
        entries.append((list(entry.hostnames), entry.key))
    return entries, revoked


def check_private_key(path: str, configured: str) -> None:
    """Refuse a key file that is missing or that others can read, as OpenSSH does."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        raise UserError(f"ssh.key: no such file {configured}") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"ssh.key: {configured} is not a file")
    if mode & 0o077:
        raise UserError(
            f"ssh.key: {configured} is accessible by others (mode {stat.S_IMODE(mode):o}); "
            f"OpenSSH refuses such keys too: chmod 600 {shlex.quote(configured)}"
        )


# -- the remote shell ----------------------------------------------------------------------------


class SSHShell:
    """`Shell` (see slurm.py) on a login node: commands by exec, files by SFTP."""

    def __init__(self, client: paramiko.SSHClient, settings: SSHSettings) -> None:
        self.client = client
        self.settings = settings
        self.where = settings.target
        self._sftp: paramiko.SFTPClient | None = None
        self.unanswered: UserError | None = None  # why _answered_within closed it

    @property
    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            timeout = self.settings.command_timeout
            try:
                with self._answered_within("SFTP", timeout):
                    self._sftp = self.client.open_sftp()
            except SFTP_ERRORS as err:
                raise sftp_error(self.settings, "SFTP failed", err) from None
            self._sftp.get_channel().settimeout(timeout)
        return self._sftp

    def run(self, argv: Sequence[str], *, timeout: float = 60.0) -> tuple[int, str, str]:
        chan = self._session(argv, timeout)
        try:
            with self._answered_within(f"`{argv[0]}`", timeout):
                chan.exec_command(shlex.join(argv))
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
            if rc == -1:  # paramiko's word for no exit status: an exit-signal, or a close
                said = one_line(bytes(err or out).decode("utf-8", "replace"))
                raise UserError(
                    f"ssh {self.where}: `{argv[0]}` ended with no exit status (killed by a "
                    "signal, or the connection closed while it ran)" + (f": {said}" if said else "")
                )
        except TimeoutError:
            raise UserError(
                f"ssh {self.where}: `{argv[0]}` did not answer within {timeout:.0f}s"
            ) from None
        except SFTP_ERRORS as err:  # a dropped connection too: EOFError is no OSError
            raise sftp_error(self.settings, f"running `{argv[0]}` failed", err) from None
        return rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")

    def _session(self, argv: Sequence[str], timeout: float):
        """A channel to run ``argv`` on; a failure here started nothing (NotSubmitted). One
        the login node did not open within ``timeout`` closes the connection and is kept as
        ``unanswered``, as ``_answered_within``'s (a listing waited for it again each row)."""
        started = time.monotonic()
        try:
            transport = self.client.get_transport()
            if transport is None or not transport.is_active():
                raise NotSubmitted(f"ssh {self.where}: the connection is closed")
            chan = transport.open_session(timeout=timeout)
            chan.settimeout(timeout)
        except SFTP_ERRORS as err:
            if time.monotonic() - started >= 0.9 * timeout:  # paramiko's "Timeout opening
                self.unanswered = NotSubmitted(  # channel.": no answer, nothing started
                    f"ssh {self.where}: `{argv[0]}` did not answer within {timeout:.0f}s "
                    "(opening its channel; the connection was closed, nothing was started)"
                )
                transport.close()
                raise self.unanswered from None
            said = sftp_error(self.settings, f"running `{argv[0]}` failed", err)
            raise NotSubmitted(str(said)) from None
        return chan

    @contextmanager
    def _answered_within(self, what: str, timeout: float):
        """Bound a request paramiko waits on with no timeout of its own (a command's exec, the
        SFTP subsystem): a login node that stopped answering there held `status` and `cancel`
        for ever. Past ``timeout`` the connection is closed, which ends the wait, and a
        UserError says so (kept as ``unanswered``: a listing does not wait for that login node
        again; outside one, the next use connects again: ``SSHBackend.shell``)."""
        transport = self.client.get_transport()
        cut_off = threading.Event()

        def close() -> None:
            cut_off.set()
            if transport is not None:
                transport.close()

        timer = threading.Timer(timeout, close)
        timer.daemon = True
        timer.start()
        try:
            yield
        except BaseException:
            if not cut_off.is_set():
                raise
        finally:
            timer.cancel()
        if cut_off.is_set():
            self.unanswered = UserError(
                f"ssh {self.where}: {what} did not answer within {timeout:.0f}s "
                "(the connection was closed)"
            )
            raise self.unanswered

    def read_from(
        self, path: str, offset: int = 0, *, limit: int = READ_LIMIT, tail: bool = False
    ) -> bytes | None:
        """As ``Shell.read_from``, over SFTP: the entry itself must be a regular file (lstat,
        then the opened handle's fstat), and no more than ``limit`` bytes are asked for."""
        try:
            f = open_remote_regular(self.sftp, path)
            if f is None:
                return None
            with f:
                start, count = read_window(f.stat().st_size or 0, offset, limit, tail)
                f.seek(start)
                f.prefetch(start + count, max_concurrent_requests=PREFETCH_REQUESTS)
                return f.read(count)
        except SFTP_ERRORS as err:
            raise sftp_error(self.settings, f"reading {path}", err) from None

    def listdir(self, path: str) -> list[str]:
        """Names that decode as UTF-8 (others cannot be a log of ours); [] when the directory
        does not exist. Any other refusal (permission, not a directory) is a UserError: an
        empty listing would read as "no logs yet" and hide it."""
        try:
            raw = listdir_raw(self.sftp, path)
        except FileNotFoundError:
            return []
        except SFTP_ERRORS as err:
            raise sftp_error(self.settings, f"listing {path}", err) from None
        return [n.decode() for n, _ in raw if n not in (b".", b"..") and _utf8(n)]

    def file_sizes(self, path: str) -> dict[str, int]:
        """``listdir``'s names that are regular files (the server's attributes are lstat's),
        with their sizes: one SFTP listing where a follower read every log twice a poll."""
        try:
            raw = listdir_raw(self.sftp, path)
        except FileNotFoundError:
            return {}
        except SFTP_ERRORS as err:
            raise sftp_error(self.settings, f"listing {path}", err) from None
        return {
            n.decode(): a.st_size or 0
            for n, a in raw
            if _utf8(n) and stat.S_ISREG(a.st_mode or 0) and a.st_size is not None
        }

    def close(self) -> None:
        """Close it, however it ended: an SFTP session on a dropped connection raised
        EOFError from its close (a traceback at the end of a verb that had said why)."""
        if self._sftp is not None:
            try:
                self._sftp.close()
            except SFTP_ERRORS:
                pass
            self._sftp = None
        self.client.close()

    def is_open(self) -> bool:
        """Whether the connection still stands (a login node may drop it: an sshd restart,
        an idle timeout)."""
        transport = self.client.get_transport()
        return transport is not None and transport.is_active()


def _install_host_keys(client: paramiko.SSHClient, s: SSHSettings) -> None:
    """The known hosts (the job's file; revocations from every file OpenSSH reads) and the
    policy for a host not listed: refused, or trusted and recorded with trust_unknown_host."""
    known = s.known_hosts_path
    hosts = KnownHosts()
    if os.path.exists(known):
        hosts.read(known)
    users = (os.path.expanduser(DEFAULT_KNOWN_HOSTS), os.path.expanduser(USER_KNOWN_HOSTS2))
    for other in (*users, *SYSTEM_KNOWN_HOSTS):
        if os.path.exists(other) and not _same_file(other, known):
            hosts.read(other, plain=s.known_hosts is None)
    hosts.install(client.get_host_keys())
    policy = _TrustAndRecord(s) if s.trust_unknown_host else _RefuseUnknown(s)
    client.set_missing_host_key_policy(_RefuseRevoked(hosts.revoked, policy))


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (read once: its plain keys are the job's own)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _connect_failure(err: BaseException, s: SSHSettings, waited: float) -> UserError | None:
    """The one-line reason a connection failed (None: not a connection failure, re-raised)."""
    t = s.connect_timeout
    if isinstance(err, _UnknownHost):
        return UserError(str(err))
    if isinstance(err, paramiko.BadHostKeyException):
        known = s.known_hosts_path
        return UserError(
            f"ssh {s.target}: the host key ({_fingerprint(err.key)}) does not match the one in "
            f"{known}: the host was reinstalled, or someone is in between; once sure, remove the "
            f"old entry with: ssh-keygen -R {shlex.quote(_known_hosts_name(s))} "
            f"-f {shlex.quote(str(known))}"
        )
    if isinstance(err, paramiko.AuthenticationException):
        how = f"key {s.key}" if s.key else "the ssh-agent and ~/.ssh keys"
        return UserError(
            f"ssh {s.target}: authentication failed with {how} ({one_line(str(err))}); "
            "passwords are not used: set ssh.key or load the key into ssh-agent"
        )
    if isinstance(err, TimeoutError):
        return UserError(f"ssh {s.target}: timed out after {t:g}s connecting")
    if isinstance(err, socket.gaierror):
        return UserError(f"ssh {s.target}: unknown host name ({err.strerror})")
    if isinstance(err, paramiko.ssh_exception.NoValidConnectionsError):
        reasons = {e.strerror or str(e) for e in err.errors.values()}
        return UserError(f"ssh {s.target}: cannot connect: {'; '.join(sorted(reasons))}")
    if isinstance(err, paramiko.SSHException):
        text = one_line(str(err))
        if waited >= 0.9 * t:  # paramiko ends a timed-out handshake quietly, then fails
            return UserError(  # on the missing session
                f"ssh {s.target}: timed out after {t:g}s waiting for the SSH handshake "
                f"(is port {s.port} an SSH server?)"
            )
        if "banner" in text or "No existing session" in text:
            return UserError(  # sshd's MaxStartups, a fail2ban: a busy login node says no
                f"ssh {s.target}: the server closed the connection during the SSH handshake "
                f"after {waited:.1f}s (a busy login node refusing new connections; is port "
                f"{s.port} an SSH server?)"
            )
        return UserError(f"ssh {s.target}: {text}")
    if isinstance(err, OSError):
        return UserError(f"ssh {s.target}: cannot connect: {err.strerror or err}")
    return None


def connect(settings: SSHSettings) -> paramiko.SSHClient:
    """An SSH connection with checked host key and key/agent authentication, or a UserError."""
    s = settings
    client = paramiko.SSHClient()
    _install_host_keys(client, s)
    key = os.path.expanduser(s.key) if s.key else None
    if key:
        check_private_key(key, s.key)
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
    except Exception as err:
        client.close()
        failure = _connect_failure(err, s, time.monotonic() - t0)
        if failure is None:
            raise
        raise failure from None
    return client


def _known_hosts_name(s: SSHSettings) -> str:
    return s.host if s.port == 22 else f"[{s.host}]:{s.port}"


# -- the backend ---------------------------------------------------------------------------------


class SSHBackend(SlurmBackend):
    """`SlurmBackend` whose commands and files are on a login node. Connects on first use;
    `close()` (or `with SSHBackend(...) as b:`) ends the connection."""

    name = "ssh"
    files_here = False  # the nodes see the login node's files, not this machine's

    @classmethod
    def create(cls, cfg) -> SSHBackend:
        """The backend for a resolved job config: its `ssh` section."""
        if not cfg.ssh.host:
            raise UserError("ssh.host: is required with backend=ssh")
        return cls(OmegaConf.to_object(cfg.ssh), expected_ranks=expected_ranks(cfg))

    def __init__(self, settings: SSHSettings, **slurm_options) -> None:
        slurm_options.setdefault("command_timeout_s", settings.command_timeout)
        super().__init__(None, **slurm_options)
        self.settings = settings
        self._remote_base: str | None = None
        self._shell_shared = False
        self._archived: str | None = None  # the attempts/<n> a resume began moving into

    def __enter__(self) -> SSHBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._shell_obj is not None and not self._shell_shared:
            self._shell_obj.close()
        self._shell_obj = None

    @property
    def shell(self) -> SSHShell:
        """The connection: a listing's, shared with its other jobs of the same settings
        (closed when the listing ends), else this backend's own."""
        if self._shell_obj is not None and not self._shell_obj.is_open():
            self.close()  # dropped (a timeout closed it, the login node did): connect again
        if self._shell_obj is None:
            settings = self.settings

            def make() -> SSHShell:
                return SSHShell(connect(settings), settings)

            key = ("ssh", repr(settings))
            listed = listing.shared(
                key, make, SSHShell.close, SSHShell.is_open, lambda shell: shell.unanswered
            )
            self._shell_shared = listed is not None
            self._shell_obj = listed if listed is not None else make()
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

    def cluster_dir(self, job_dir: Path) -> str:
        """Where the job lives on the login node: job.json's remote.dir (checked: the file can
        be edited, and a string there was an AttributeError traceback in every verb), else the
        remote base's folder of the job's name."""
        job = JobDir(job_dir)
        remote = job.read_meta().get("remote") or {}
        if not isinstance(remote, dict):
            raise UserError(f"{job.meta_file}: remote: expected an object, got {cut(repr(remote))}")
        recorded = remote.get("dir")
        if recorded is not None and not (
            isinstance(recorded, str)
            and posixpath.isabs(recorded)
            and path_problem(recorded) is None
        ):
            raise UserError(
                f"{job.meta_file}: remote.dir: expected an absolute path, got {cut(repr(recorded))}"
            )
        return recorded or posixpath.join(self.remote_base(), Path(job_dir).resolve().name)

    def check_named_files(self, named: list[NamedFile]) -> None:
        """Each file the job names, looked for on the login node (the ranks read the files
        there, and this machine's may be others or none): a required one missing is refused,
        as are inputs none of which exists; a missing input the job reports is said."""
        missing = [n for n in named if not self._remote_exists(n)]
        target = self.settings.target
        for n in missing:
            if n.required:
                raise UserError(
                    f"{n.key}: {n.path} does not exist on the login node {target}. "
                    "Nothing was submitted"
                )
        inputs = [n for n in named if n.key == "task.inputs"]
        if inputs and all(n in missing for n in inputs):
            raise UserError(
                f"task.inputs: none of them exists on the login node {target} "
                f"({', '.join(n.path for n in inputs)}). Nothing was submitted"
            )
        for n in missing:
            print(f"warning: {n.key}: {n.path} does not exist on {target}", file=sys.stderr)

    def _remote_exists(self, named: NamedFile) -> bool:
        try:
            self.shell.sftp.stat(named.path)  # a link is followed, as the ranks follow it
        except FileNotFoundError:
            return False
        except SFTP_ERRORS as err:
            raise sftp_error(self.settings, f"{named.key}: looking for {named.path}", err) from None
        return True

    def kept_place(self, place: str) -> str:
        """On the login node: this directory has it once fetched (a status read "its logs are
        in attempts/requeue-42-1", and there was no such folder here)."""
        return f"{place} on {self.settings.target} (`ringctl fetch` copies it here)"

    def gone(self, job_dir: Path) -> str | None:
        """Why the job's directory on the login node is not there (moved, or a scratch
        purge), None when it is. Status then read every rank as ended without a result
        (FAILED), `logs` printed nothing, and a resume started the job over in a new one."""
        remote = self.cluster_dir(job_dir)
        try:
            mode = self.shell.sftp.lstat(remote).st_mode or 0
        except FileNotFoundError:
            mode = None
        except SFTP_ERRORS as err:
            raise sftp_error(self.settings, f"reading {remote}", err) from None
        if mode is not None and stat.S_ISDIR(mode):
            return None
        what = "is gone (moved, or purged)" if mode is None else "is no longer a directory"
        return f"ssh {self.settings.target}: the job's directory {remote} {what}"

    def status(self, job_dir: Path) -> JobStatus:
        gone = self.gone(job_dir)
        if gone:
            job_id = self._job_id(job_dir)
            why = f"{gone}: the job's state cannot be read there"
            return JobStatus(job_id, JobState.UNKNOWN, reason=why)
        return super().status(job_dir)

    def logs(self, job_dir: Path, *, rank: int | None = None, follow: bool = False):
        gone = self.gone(job_dir)
        if gone:
            raise UserError(f"{gone}: no logs to read there (`ringctl fetch` brought what it had)")
        yield from super().logs(job_dir, rank=rank, follow=follow)

    def refuse_resume(self, job: JobDir) -> None:
        """A login-node copy that is gone: the resume would start the job over there."""
        gone = self.gone(job.path)
        if gone:
            raise UserError(
                f"{gone}: a resume continues the job there, and would compute every document "
                "again; put the directory back, or submit a new job"
            )
        attempts = posixpath.join(self.cluster_dir(job.path), ATTEMPTS)
        try:
            _refuse_linked(self.shell.sftp, attempts, self.settings.target)
        except SFTP_ERRORS as err:
            raise sftp_error(self.settings, f"reading {attempts}", err) from None

    def prepare_resume(self, job: JobDir) -> None:
        """The remote copy stays where it is (its out/ holds the finished work): its logs and
        placement move to attempts/<n> there too, and config.yaml/job.sh are sent again."""
        super().prepare_resume(job)
        attempts = job.read_meta().get("attempts") or [{}]
        self._resume_attempt = Path(str(attempts[-1].get("dir", "attempt"))).name

    def _prepare(self, job_dir: Path) -> str:
        if getattr(self, "_resume_attempt", None):
            return self._prepare_resumed(JobDir(job_dir))
        remote = posixpath.join(self.remote_base(), Path(job_dir).resolve().name)
        sftp = self.shell.sftp
        try:
            sftp.stat(remote)
        except FileNotFoundError:
            pass
        except SFTP_ERRORS as err:
            raise sftp_error(self.settings, f"ssh.remote_dir: {remote}", err) from None
        else:
            raise UserError(
                f"ssh {self.settings.target}: {remote} already exists on the login node "
                "(a job directory of the same name); remove it or rename the job"
            )
        try:
            self._mkdirs(self.remote_base())
        except SFTP_ERRORS as err:
            what = f"ssh.remote_dir: cannot create {self.remote_base()} (is part of it a file?)"
            raise sftp_error(self.settings, what, err) from None
        self._upload(Path(job_dir), remote)
        return remote

    def _prepare_resumed(self, job: JobDir) -> str:
        remote = self.cluster_dir(job.path)
        sftp = self.shell.sftp
        archive = posixpath.join(remote, attempt_name(self._resume_attempt))
        try:
            for path in (posixpath.dirname(archive), archive):
                _refuse_linked(sftp, path, self.settings.target)
            if _is_real_dir(sftp, archive) and sftp.listdir(archive):
                raise UserError(  # a resume that could not be put back left them (host down)
                    f"ssh {self.settings.target}: {archive} already holds files (an earlier "
                    f"resume's, not put back): move them back into {remote}, or remove them"
                )
            self._archived = archive  # from here on, undo_resume has this resume's to undo
            self._mkdirs(archive)
            _move_archived(sftp, remote, archive)
            sftp.mkdir(posixpath.join(remote, LOGS), mode=_mode(job.logs))
            _resend(sftp, job, remote)
        except SFTP_ERRORS as err:
            what = f"preparing {remote} for the resumed job failed"
            raise sftp_error(self.settings, what, err) from None
        self._resume_attempt = None
        return remote

    def undo_resume(self, job: JobDir, attempt: str) -> list[str]:
        """The login node's copy as it was before a resume whose sbatch failed: the logs and
        placement moved to attempts/<n> there come back, config.yaml and job.sh (put back
        here) are sent again. Nothing was moved where the failure came first."""
        self._resume_attempt = None
        remote = self.cluster_dir(job.path)
        archive = posixpath.join(remote, attempt_name(attempt))
        if self._archived != archive:  # this resume moved nothing there
            return []  # (a refusal before: what is there is an earlier resume's, said so)
        self._archived = None
        sftp = self.shell.sftp
        try:
            if not _is_real_dir(sftp, archive):
                return []
            fresh = posixpath.join(remote, LOGS)
            if _is_real_dir(sftp, fresh) and not sftp.listdir(fresh):
                sftp.rmdir(fresh)
            _move_archived(sftp, archive, remote)
            _resend(sftp, job, remote)
            if not sftp.listdir(archive):
                sftp.rmdir(archive)
        except (*SFTP_ERRORS, OSError) as err:
            return [f"on {self.settings.target}, {remote} was not put back: {one_line(str(err))}"]
        return []

    def cancel_command(self, job_dir: Path, job_id: str) -> str:
        """The ssh command that cancels the job, as ringctl connects: its key and known_hosts
        file too (without them the printed line did not reach a host ringctl reached)."""
        s = self.settings
        port = ["-p", str(s.port)] if s.port != 22 else []
        key = ["-i", os.path.expanduser(s.key)] if s.key else []
        known = ["-o", f"UserKnownHostsFile={s.known_hosts_path}"] if s.known_hosts else []
        login = f"{s.user}@{s.host}" if s.user else s.host
        return shlex.join(["ssh", *port, *key, *known, login, "scancel", job_id])

    def _submitted_fields(self, job_dir: Path, cluster_dir: str) -> dict:
        s = self.settings
        return {"remote": {"host": s.host, "port": s.port, "user": s.user, "dir": cluster_dir}}

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
        """The job directory copied to ``remote`` (which did not exist); on a failure, the
        partial copy is removed where the connection still allows, else named."""
        sftp = self.shell.sftp
        made = False  # only a folder this submission made is removed on a failure
        try:
            sftp.mkdir(remote, mode=_mode(local))
            made = True
            for root, dirs, files in os.walk(local):
                rel = os.path.relpath(root, local)
                rdir = remote if rel == "." else posixpath.join(remote, *Path(rel).parts)
                for d in sorted(dirs):
                    sftp.mkdir(posixpath.join(rdir, d), mode=_mode(Path(root, d)))
                for f in sorted(files):
                    src = os.path.join(root, f)
                    dst = posixpath.join(rdir, f)
                    sftp.put(src, dst)
                    sftp.chmod(dst, _mode(src))
            if not JobDir(local).logs.is_dir():
                sftp.mkdir(posixpath.join(remote, LOGS), mode=_mode(local))
        except SFTP_ERRORS as err:  # a dropped connection too: nothing was submitted
            said = sftp_error(self.settings, f"uploading the job directory to {remote} failed", err)
            self.close()  # a transfer broke on it: a new connection (its end may not show yet)
            raise UserError(f"{said}{self._remove_partial(remote) if made else ''}") from None

    def _remove_partial(self, remote: str) -> str:
        """Remove a copy this submission made and could not finish (rm -rf of that one path,
        as an argument, on a new connection if the old one dropped); what is left, said."""
        try:
            rc, _, err = self.shell.run(["rm", "-rf", "--", remote], timeout=self.command_timeout_s)
        except UserError as err_:
            rc, err = 1, str(err_)
        if rc == 0:
            return "; the partial copy there was removed"
        return f"; a partial copy may remain at {remote} on the login node ({one_line(err)})"

    def fetch(self, job_dir: Path) -> list[str]:
        """Copy the job's outputs, logs, probes and placement back from the login node; return
        the relative paths fetched. Nothing else, and nothing outside the job directory."""
        job = JobDir(Path(job_dir).resolve())
        remote = self.cluster_dir(job.path)
        fetched: list[str] = []
        unpointed: list[str] = []  # the folder brought where the login node has no latest
        gone = self.gone(job.path)  # first: a link in its place would fetch another job's
        if gone:
            raise RemoteGone(f"{gone}: nothing was fetched (the copy here is the last fetch's)")
        try:
            for rpath, rel in self._fetchable(remote, unpointed):
                if fetch_one(self.shell.sftp, rpath, job.path, rel):
                    fetched.append(rel)
        except SFTP_ERRORS as err:
            what = f"fetching {remote} failed after {len(fetched)} files"
            raise sftp_error(self.settings, what, err) from None
        # By what the login node holds, not by what came: a latest refused here (a folder in
        # its place) was taken for none there, and the local copy's latest removed as one.
        if unpointed:
            if any(r.startswith(f"{CHECKPOINTS}/{unpointed[0]}/") for r in fetched):
                _mirror_unpointed(job.checkpoints, unpointed[0])
        elif f"{CHECKPOINTS}/{LATEST}" in fetched:
            _drop_earlier_checkpoints(job.checkpoints)
        job.update_meta(fetched_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        return fetched

    def _fetchable(self, remote: str, unpointed: list[str]) -> Iterator[tuple[str, str]]:
        """(remote path, relative local path) of the regular files that may come back; the
        checkpoint folder taken where the login node has no ``latest`` is put in ``unpointed``."""
        sftp = self.shell.sftp  # the outputs, logs, probes and earlier attempts' logs (those
        # a Slurm requeue kept exist only on the login node), then placement.json
        for top in FETCHED_DIRS:
            rdir = posixpath.join(remote, top)
            if not _top_entry_is(sftp, rdir, stat.S_ISDIR, f"{top}/", "a directory"):
                continue
            if top == CHECKPOINTS:
                yield from self._newest_checkpoint(rdir, unpointed)
            else:
                yield from _walk_remote(sftp, rdir, top)
        rpath = posixpath.join(remote, PLACEMENT)
        if _top_entry_is(sftp, rpath, stat.S_ISREG, PLACEMENT, "a regular file"):
            yield rpath, PLACEMENT

    def _newest_checkpoint(self, rdir: str, unpointed: list[str]) -> Iterator[tuple[str, str]]:
        """Of checkpoints/: the folder ``latest`` names, then ``latest`` itself, last (it
        names a folder already here). Every folder ever fetched came back before (the job
        prunes them; one pruned mid-copy arrived half, the staging folders too), and
        ``latest``, fetched first, could name a folder published after the listing: a
        gather --partial of a running job failed, or read a half folder. A ``latest`` that
        names no step comes as it is: gather refuses it by name, as a resume there does (it
        was left out, and gather read the older step an earlier fetch's ``latest`` named)."""
        latest = posixpath.join(rdir, LATEST)
        raw = self.shell.read_from(latest, 0, limit=64)
        if raw is None:  # lost, or a kill between a folder's publish and latest's write
            yield from self._unpointed_checkpoint(rdir, unpointed)
            return
        name = raw.decode("utf-8", errors="replace").strip()
        if not STEP_NAME.fullmatch(name):
            _warn(
                f"{CHECKPOINTS}/{LATEST} on the login node names no checkpoint "
                f"({echo(name)}): copied as it is (gather and a resume refuse it)"
            )
            yield latest, f"{CHECKPOINTS}/{LATEST}"
            return
        yield from _walk_remote(
            self.shell.sftp, posixpath.join(rdir, name), f"{CHECKPOINTS}/{name}"
        )
        yield latest, f"{CHECKPOINTS}/{LATEST}"

    def _unpointed_checkpoint(self, rdir: str, unpointed: list[str]) -> Iterator[tuple[str, str]]:
        """With no ``latest`` on the login node, its newest published folder (a real folder
        named step-N, never a staging one), as a resume there takes it
        (``CheckpointDir.unpointed``): none came back before, and gather --partial said
        "no checkpoint yet" of a job that had saved."""
        steps = []
        for raw, entry in listdir_raw(self.shell.sftp, rdir):
            step = checkpoint_step(raw.decode("utf-8", errors="replace"))
            if step is not None and stat.S_ISDIR(entry.st_mode or 0):  # lstat: not a link
                steps.append(step)
        if not steps:
            return
        name = step_name(max(steps))
        unpointed.append(name)
        _warn(
            f"{CHECKPOINTS}/{LATEST} is missing on the login node: fetching its newest "
            f"published folder, {name}"
        )
        yield from _walk_remote(
            self.shell.sftp, posixpath.join(rdir, name), f"{CHECKPOINTS}/{name}"
        )


def _drop_earlier_checkpoints(root: Path) -> None:
    """An ssh job's local checkpoints/ is a copy of the folder the login node's ``latest``
    names (just fetched): the folders earlier fetches brought go (the job has pruned them
    since; each is the model's and the optimizer's state, gigabytes a fetch)."""
    from ..train.checkpoint import CheckpointDir

    checkpoints = CheckpointDir(root)
    try:  # the folder latest names arrived (a job that moved on meanwhile pruned it there)
        newest = checkpoints.latest()
    except ValueError:
        return
    if newest is not None:
        _keep_only(checkpoints, newest.path.name)


def _keep_only(checkpoints, name: str) -> None:
    """Remove every complete checkpoint folder here but ``name`` (real folders named step-N,
    never a link: ``CheckpointDir.complete``)."""
    for folder in checkpoints.complete():
        if folder.name != name:
            shutil.rmtree(folder)


def _mirror_unpointed(root: Path, fetched: str) -> None:
    """A fetch that found no ``latest`` on the login node brought its newest published
    folder, ``fetched``: the local copy is that folder alone. A ``latest`` an earlier fetch
    left here would name an older step (gather would read it), and a folder here the login
    node no longer has (a later step it lost with its ``latest``) would be taken as newer."""
    from ..train.checkpoint import CheckpointDir

    try:
        os.unlink(root / LATEST)
    except FileNotFoundError:
        pass
    _keep_only(CheckpointDir(root), fetched)


def _move_archived(sftp, source: str, target: str) -> None:
    """The names a resume archives (logs, placement) from one folder to the other on the
    login node: into attempts/<n> for a resume, back for one put back."""
    for name in ARCHIVED_ON_RESUME:
        try:
            sftp.rename(posixpath.join(source, name), posixpath.join(target, name))
        except FileNotFoundError:
            pass


def _resend(sftp, job: JobDir, remote: str) -> None:
    """config.yaml and job.sh as they are here, to the login node's copy."""
    for name in RESENT_ON_RESUME:
        _replace_remote(sftp, job.path / name, posixpath.join(remote, name))


def _is_real_dir(sftp, path: str) -> bool:
    """Whether ``path`` on the login node is a folder itself, not a link to one (lstat)."""
    try:
        return stat.S_ISDIR(sftp.lstat(path).st_mode or 0)
    except FileNotFoundError:
        return False


def _refuse_linked(sftp, path: str, target: str) -> None:
    """A folder resume moves files into must be the job's own: the job writes its remote
    directory, and an attempts/ it made a link had the logs moved wherever it pointed."""
    try:
        mode = sftp.lstat(path).st_mode or 0
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise UserError(
            f"ssh {target}: {path} is not a folder (a link?); nothing was moved, so the "
            "resume stops: remove it on the login node"
        )


def _replace_remote(sftp, local: Path, remote: str) -> None:
    """``local``'s bytes and mode in place of the remote file, never through what is there: a
    new file of an unguessable name (created exclusively: no link or file of that name is
    opened), then renamed over the entry (a link there is replaced, not followed). The job
    itself can write its directory: a config.yaml it made a link sent a resume's upload,
    and its chmod, to any file the login node's user can write."""
    tmp = posixpath.join(posixpath.dirname(remote), f".{secrets.token_hex(8)}.upload")
    try:
        with sftp.open(tmp, "wx") as f:  # O_CREAT | O_EXCL: never an existing entry
            f.write(local.read_bytes())
            f.chmod(_mode(local))
        sftp.posix_rename(tmp, remote)
    except BaseException:
        try:
            sftp.remove(tmp)
        except SFTP_ERRORS:
            pass
        raise


def _mode(local: str | Path) -> int:
    """The permission bits of a local file or directory, for its remote copy: the job directory
    follows the umask it was made under (job.sh holds env.vars, tokens among them), and so does
    its copy on the login node."""
    return stat.S_IMODE(os.stat(local).st_mode)


_MAX_NAME = 200  # bytes: room for a temporary suffix within the usual 255-byte limit
_MAX_DEPTH = 8


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _safe_name(raw: str | bytes) -> str | None:
    """A remote file name usable locally: one UTF-8 path component, not a dot file."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if (
        not raw
        or raw in (".", "..")
        or raw.startswith(".")
        or "/" in raw
        or "\\" in raw
        or "\x00" in raw
        or any(ord(c) < 32 for c in raw)
        or len(raw.encode("utf-8", "surrogateescape")) > _MAX_NAME
    ):
        return None
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:  # paramiko decodes undecodable names with surrogates
        return None
    return raw


def _warn(message: str) -> None:
    print(f"ringctl: warning: {message}", file=sys.stderr)


def listdir_raw(sftp: paramiko.SFTPClient, path: str) -> list[tuple[bytes, SFTPAttributes]]:
    """(name as bytes, attributes) of a remote directory's entries.

    paramiko's listdir_attr decodes every name as strict UTF-8, so one file with another
    encoding fails the whole listing; this is the same SFTP exchange (OPENDIR, READDIR until
    EOF, CLOSE) keeping the raw names."""
    kind, msg = sftp._request(sftp_proto.CMD_OPENDIR, path)
    if kind != sftp_proto.CMD_HANDLE:
        raise OSError(f"{path}: no directory handle")
    handle = msg.get_binary()
    entries = []
    try:
        while True:
            try:
                kind, msg = sftp._request(sftp_proto.CMD_READDIR, handle)
            except EOFError:
                break
            if kind != sftp_proto.CMD_NAME:
                raise OSError(f"{path}: unexpected SFTP reply")
            for _ in range(msg.get_int()):
                name, longname = msg.get_string(), msg.get_string()
                entries.append((name, SFTPAttributes._from_msg(msg, name, longname)))
    finally:
        sftp._request(sftp_proto.CMD_CLOSE, handle)
    return entries


# What an SFTP exchange raises: the server's refusals (OSError), a dropped connection
# (paramiko's SSHException, EOFError: neither an OSError) and a timeout (an OSError).
SFTP_ERRORS = (OSError, paramiko.SSHException, EOFError)
PREFETCH_REQUESTS = 256  # SFTP reads in flight: paramiko's default is unbounded (a failed
# local write then left millions queued, and closing the file never returned)


def open_remote_regular(sftp, path: str):
    """The remote file opened for reading if the entry itself (lstat: a link is not followed)
    is a regular file and the opened handle is one too; None when absent. A link, pipe or
    device is an OSError naming it: opening a FIFO blocks the server, /dev/zero never ends."""
    try:
        mode = sftp.lstat(path).st_mode or 0
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(mode):
        raise NotRegular(f"{path} is not a regular file (a link, a pipe, a device or a folder)")
    f = sftp.open(path, "rb")
    if not stat.S_ISREG(f.stat().st_mode or 0):  # swapped between the lstat and the open
        f.close()
        raise NotRegular(f"{path} is not a regular file (it changed while being opened)")
    return f


class NotRegular(OSError):
    """A remote entry that is not a regular file where one is read."""


def sftp_error(settings: SSHSettings, what: str, err: BaseException) -> UserError:
    """An SFTP failure in one line, ``ssh TARGET: WHAT: WHY``: a timeout says so (its message
    is empty), a dropped connection too (paramiko's SSHException and EOFError are not
    OSErrors)."""
    if isinstance(err, TimeoutError):
        why = f"timed out (no answer within {settings.command_timeout:.0f}s)"
    elif isinstance(err, EOFError):
        why = "the connection closed"
    else:
        why = one_line(str(err)) or type(err).__name__
    return UserError(f"ssh {settings.target}: {what}: {why}")


def _top_entry_is(sftp, rpath: str, kind, rel: str, what: str) -> bool:
    """Whether the remote entry (not what a symlink there points to) exists and is of `kind`
    (stat.S_ISDIR, S_ISREG); anything else is skipped with a warning. Opening `attempts/` as a
    directory would follow a link to anywhere on the login node."""
    try:
        mode = sftp.lstat(rpath).st_mode or 0
    except FileNotFoundError:
        return False
    if kind(mode):
        return True
    link = " (a symbolic link)" if stat.S_ISLNK(mode) else ""
    _warn(f"did not fetch {rel}: on the login node it is not {what}{link}")
    return False


def _walk_remote(sftp, rdir: str, rel: str, depth: int = 0) -> Iterator[tuple[str, str]]:
    try:
        entries = listdir_raw(sftp, rdir)
    except FileNotFoundError:
        return
    for raw, entry in entries:
        if raw in (b".", b".."):
            continue
        name = DCP_METADATA if _is_dcp_metadata(raw, rel) else _safe_name(raw)
        if name is None:
            _warn(f"skipped the remote file {raw!r} in {rdir}: not a usable name")
            continue
        mode = entry.st_mode or 0
        if stat.S_ISDIR(mode) and depth >= _MAX_DEPTH:
            _warn(f"did not fetch {rel}/{name}/: folders nest at most {_MAX_DEPTH} deep")
        elif stat.S_ISDIR(mode):
            yield from _walk_remote(sftp, posixpath.join(rdir, name), f"{rel}/{name}", depth + 1)
        elif stat.S_ISREG(mode):
            yield posixpath.join(rdir, name), f"{rel}/{name}"
        else:  # links, FIFOs, devices never come back: said (gather then names it missing)
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
            _warn(f"did not fetch {rel}/{name}: on the login node it is {kind}")


def _is_dcp_metadata(raw: bytes, rel: str) -> bool:
    """A checkpoint folder's DCP index (checkpoints/step-N/.metadata): a dot file, which
    names are otherwise refused for, and without which no training job fetched over SSH
    could be gathered or resumed here."""
    parts = rel.split("/")
    return raw == DCP_METADATA.encode() and len(parts) == 2 and parts[0] == CHECKPOINTS


def fetch_one(sftp, rpath: str, job_dir: Path, rel: str) -> bool:
    """Download one file to job_dir/rel through a temporary name; False (and a warning) when
    the local path would leave the job directory, pass through a symlink or replace a control
    file or a folder, or the remote entry is no longer a regular file. The remote file's size
    (its handle's fstat) bounds what is read, and must fit the local disk before anything is
    written: a sparse terabyte on the login node, or a file swapped for /dev/zero, is refused."""
    from ..jobdir import CONTROL_FILES

    target = job_dir / rel
    if rel in CONTROL_FILES or target.name in CONTROL_FILES and target.parent == job_dir:
        _warn(f"did not fetch {rel}: a control file is never replaced from the remote copy")
        return False
    if not _local_folders(job_dir, Path(rel).parent) or target.is_symlink() or target.is_dir():
        _warn(f"did not fetch {rel}: its local path leaves {job_dir} or is not a file's")
        return False
    try:
        f = open_remote_regular(sftp, rpath)
    except FileNotFoundError:
        f = None
    except NotRegular:  # listed as a file, then made something else
        _warn(f"did not fetch {rel}: on the login node it is no longer a regular file")
        return False
    if f is None:  # listed, then gone: a requeued run's script moves its earlier logs
        _warn(f"did not fetch {rel}: it was removed or moved on the login node meanwhile")
        return False
    with f:
        size = f.stat().st_size or 0
        free = shutil.disk_usage(target.parent).free
        if size + FETCH_HEADROOM > free:
            raise OSError(
                f"{rel} holds {size:,} bytes on the login node; {target.parent} has "
                f"{free:,} free: nothing of it was written"
            )
        _download(f, size, target)
    return True


FETCH_HEADROOM = 64 << 20  # bytes a fetch leaves free on the local disk
_WINDOW = 8 << 20  # bytes asked for at once: a failed write leaves at most this in flight
_PIECE = 32 << 10  # one SFTP read (paramiko's own size; a larger read is reassembled slowly)


def _download(f, size: int, target: Path) -> None:
    """``size`` bytes of the open remote file into ``target``, through a temporary name that
    is removed on any failure (a full disk, an interrupt): a file is whole or absent."""
    tmp = target.parent / f".{target.name}.fetch.tmp"
    try:
        with open(tmp, "wb") as out:
            for start in range(0, size, _WINDOW):  # a window's reads in flight at a time
                stop = min(start + _WINDOW, size)
                pieces = [(at, min(_PIECE, stop - at)) for at in range(start, stop, _PIECE)]
                for (_, want), data in zip(pieces, f.readv(pieces, PREFETCH_REQUESTS), strict=True):
                    if len(data) != want:
                        raise OSError(f"{target.name}: the remote file ended early (it shrank)")
                    out.write(data)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _local_folders(job_dir: Path, parent: Path) -> bool:
    """Create ``job_dir/parent`` a folder at a time, each one a real folder (not a link, not
    a file) inside ``job_dir``: False, creating nothing further, where one is not. Checking
    before creating keeps a remote listing from making folders where a local link points."""
    here = job_dir
    for part in parent.parts:
        here = here / part
        if here.is_symlink() or (here.exists() and not here.is_dir()):
            return False
        here.mkdir(exist_ok=True)
    return here.resolve() == here and here.is_relative_to(job_dir)
