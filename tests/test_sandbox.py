"""Solutions that attack the harness, planted the way a determined competitor would write them and judged through
the entry points users use (runner.evaluate, harness.run.main): each gets its status with a one-line log, what it
aims at is unchanged afterwards, and the honest solution judged after it in the same run still passes.

Every attack runs inside the bubblewrap sandbox only (skipped without it, and test_solutions_run_sandboxed_here
fails instead): unsandboxed, they would kill the test run or write into what they target. What they target is a
copy or a file made by the test; each attack notes in its home how each step went, so that a test can tell the
step was tried and failed rather than never reached."""
from __future__ import annotations

import importlib.util
import marshal
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import harness.run as harness_run
from conftest import DEFINITION, PROJECT, ROOT, make_solution
from harness import runner, sandbox
from harness.project import Project, Settings
from harness.solutions import load_solution, source_sha256
from harness.definition import find_definition
from harness.workloads import load_inputs, load_workloads, select

HONEST = "torch_v1"
DATA = ("definitions", "workloads", "traces")       # what a run reads from the repository
TIMEOUT_S = 60.0
HANG_TIMEOUT_S = 8.0     # where an attack hangs: well above the worker's start-up (about 2 s here)

needs_sandbox = pytest.mark.skipif(sandbox.unavailable() is not None,
                                   reason=f"no sandbox here ({sandbox.unavailable()}): the attack would run for real")

# Prepended to an attack's main.py once its template is filled: attempt(what, action) runs one step and appends
# "what: outcome" to ~/attempts.txt, the outcome being "done" or the errno name of the OSError that stopped it.
ATTEMPT = '''\
import errno
import os


def attempt(what, action):
    try:
        action()
        outcome = "done"
    except OSError as e:
        outcome = errno.errorcode.get(e.errno, str(e.errno))
    with open(os.path.expanduser("~/attempts.txt"), "a") as log:
        log.write(f"{what}: {outcome}\\n")
'''


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """The solutions' homes (the one place a worker may write) under tmp_path: fresh for each test, read by it,
    and removed with it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def one(defn):
    return select(load_workloads(defn, PROJECT.workload_file(defn)), [1], ["random"])


@pytest.fixture
def repo(tmp_path):
    """A project copied from what a run reads from the repository, plus the honest solution (run_cli runs in it):
    the attacks on repository files target this copy."""
    copy = tmp_path / "repo"
    for part in DATA:
        shutil.copytree(ROOT / part, copy / part)
    shutil.copytree(ROOT / "solutions" / HONEST, copy / "solutions" / HONEST)
    project = Project.at(copy)
    defn = find_definition(DEFINITION, project.definitions)
    for w in select(load_workloads(defn, project.workload_file(defn)), [1], ["random"]):
        load_inputs(defn, w, root=copy)         # its blob now, as a clean checkout's run makes it, not during the test
    return copy


def plant(defn, folder: Path, name: str, code: str, **kwargs):
    make_solution(folder, name, code, **kwargs)
    return load_solution(name, defn, folder)


def judge(defn, sol, workloads, timeout_s=TIMEOUT_S, **kwargs) -> list[runner.Result]:
    results = runner.evaluate(defn, sol, workloads, "cpu", root=PROJECT.root, settings=Settings(timeout_s=timeout_s),
                              **kwargs)
    assert all(r.isolation == "bwrap" for r in results), results[0].isolation
    return results


def assert_honest_passes(defn, workloads) -> None:
    results = judge(defn, load_solution(HONEST, defn, ROOT / "solutions"), workloads)
    assert [r.status for r in results] == [runner.PASSED] * len(workloads), [r.log for r in results]


def run_cli(monkeypatch, project: Path, *names: str) -> tuple[int, list[runner.Result]]:
    """harness.run.main on the named solutions of the project at B=1, family random: its exit code and every
    result, in order."""
    results = []

    def evaluate_and_keep(*args, **kwargs):
        done = runner.evaluate(*args, **kwargs)
        results.extend(done)
        return done
    monkeypatch.setattr(harness_run, "evaluate", evaluate_and_keep)
    argv = [arg for name in names for arg in ("--solution", name)]
    code = harness_run.main(argv + ["--device", "cpu", "--batch-sizes", "1", "--families", "random", "--no-traces",
                                    "--timeout", f"{TIMEOUT_S:g}", "--project", str(project)])
    assert all(r.isolation == "bwrap" for r in results)
    return code, results


def one_line(log: str) -> bool:
    return "\n" not in log and "Traceback" not in log


def home_of(name: str) -> Path:
    """The home of the planted solution `name` judged last (each planted folder has its own)."""
    homes = [p for p in (sandbox.cache_root() / "home").glob(f"{name}@*-*") if p.is_dir()]
    return max(homes, key=lambda p: p.stat().st_mtime)


def attempts(name: str) -> dict[str, str]:
    lines = (home_of(name) / "attempts.txt").read_text().splitlines()
    return dict(line.rsplit(": ", 1) for line in lines)


def snapshot(folder: Path, parts=DATA) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes()
            for part in parts for p in sorted((folder / part).rglob("*")) if p.is_file()}


def test_solutions_run_sandboxed_here():
    assert sandbox.unavailable() is None


# 1. Kill the harness ---------------------------------------------------------------------------------------------

KILLER = '''
import signal

from flush import run as flush

HARNESS_PID, HARNESS_PGID = {pid}, {pgid}       # the harness's process and group, as if guessed right


def run(*x):
    attempt("kill the harness", lambda: os.kill(HARNESS_PID, signal.SIGKILL))
    attempt("kill the harness's group", lambda: os.killpg(HARNESS_PGID, signal.SIGKILL))
    attempt("kill the parent", lambda: os.kill(os.getppid(), signal.SIGKILL))
    attempt("kill the parent's group", lambda: os.killpg(os.getpgid(os.getppid()), signal.SIGKILL))
    return flush(*x)
'''


@needs_sandbox
def test_killing_the_harness_fails(repo, monkeypatch):
    """In its PID namespace the harness's pid and group do not exist, the worker's parent is the namespace's init
    (which ignores signals sent from inside) and nothing else lives there: every kill misses, and the attack goes
    on to return the honest outputs."""
    make_solution(repo / "solutions", "killer", ATTEMPT + KILLER.format(pid=os.getpid(), pgid=os.getpgrp()))
    code, results = run_cli(monkeypatch, repo, "killer", HONEST)
    assert [(r.solution, r.status) for r in results] == [("killer", runner.PASSED), (HONEST, runner.PASSED)]
    assert code == 0
    tried = attempts("killer")
    assert tried["kill the harness"] == tried["kill the harness's group"] == "ESRCH"
    assert {"kill the parent", "kill the parent's group"} <= set(tried)


# 2. Vandalize the repository ---------------------------------------------------------------------------------------

VANDAL = '''
import atexit

from flush import run as flush

REPO = {repo!r}          # the repository the harness runs from
KNOWN = {known!r}        # its files, known from the public repository
HARNESS_PID = {pid}


def flip_first_byte(path):
    with open(path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))


def forge_trace():
    with open(os.path.join(REPO, "traces", {definition!r}, "vandal.jsonl"), "w") as f:
        f.write('{{"solution": "vandal", "evaluation": {{"status": "PASSED"}}}}\\n')


def vandalize():
    found = [os.path.relpath(os.path.join(d, n), REPO) for d, _, names in os.walk(REPO) for n in names]
    for rel in sorted(set(KNOWN) | set(found)):
        attempt(f"flip {{rel}}", lambda rel=rel: flip_first_byte(os.path.join(REPO, rel)))
    attempt("flip through the harness's cwd", lambda: flip_first_byte(f"/proc/{{HARNESS_PID}}/cwd/{{KNOWN[0]}}"))
    attempt("forge a trace", forge_trace)


atexit.register(vandalize)          # and on the way out, in case the harness reads the files again after the run


def run(*x):
    vandalize()
    return flush(*x)
'''


@needs_sandbox
def test_repository_files_cannot_be_changed(repo, monkeypatch):
    before = snapshot(repo)
    code = ATTEMPT + VANDAL.format(repo=str(repo), known=sorted(before), pid=os.getpid(), definition=DEFINITION)
    make_solution(repo / "solutions", "vandal", code)
    exit_code, results = run_cli(monkeypatch, repo, "vandal", HONEST)
    assert [(r.solution, r.status) for r in results] == [("vandal", runner.PASSED), (HONEST, runner.PASSED)]
    assert exit_code == 0
    assert snapshot(repo) == before
    tried = attempts("vandal")
    assert {f"flip {rel}" for rel in before} <= set(tried)
    assert "done" not in tried.values(), tried


PEEK = '''
import os

from flush import run as flush

REPO, SECRETS = {repo!r}, {secrets!r}


def run(*x):
    if os.path.exists(REPO) and os.listdir(REPO):
        raise RuntimeError(f"the repository is visible: {{sorted(os.listdir(REPO))}}")
    for secret in SECRETS:
        if os.path.exists(secret):
            raise RuntimeError(f"{{secret}} is visible")
    return flush(*x)
'''


@needs_sandbox
def test_the_repository_its_neighbours_and_the_home_are_hidden_from_a_solution(repo, tmp_path):
    """As users run it: `python -m harness.run` from the repository root, in a process of its own. Neither the
    repository, nor a checkout beside it, nor the user's home (where credentials live) can be read: an exception
    carries what it read into the run's table and the traces."""
    sibling, home = tmp_path / "other_checkout" / "secret.txt", tmp_path / "user_home" / ".netrc"
    for secret in (sibling, home):
        secret.parent.mkdir()
        secret.write_text("password")
    make_solution(repo / "solutions", "peek", PEEK.format(repo=str(repo), secrets=[str(sibling), str(home)]))
    done = subprocess.run([sys.executable, "-m", "harness.run", "--solution", "peek", "--device", "cpu",
                           "--batch-sizes", "1", "--families", "random", "--no-traces"],
                          cwd=repo, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HOME": str(home.parent)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]



SOCKET_DIALER = """
import socket

from flush import run as flush


def run(*x):
    dialer = socket.socket(socket.AF_UNIX)
    try:
        dialer.connect({path!r})
    except OSError:
        return flush(*x)
    raise RuntimeError("connected to a service of the host")
"""


@needs_sandbox
def test_the_hosts_service_sockets_are_out_of_reach(defn, one, tmp_path):
    """No network still lets a process connect to a Unix socket file it can see (docker's, a database's): the
    folders services keep them in are hidden."""
    folder = Path("/run") / f"harness-test-{uuid.uuid4().hex}"
    try:
        folder.mkdir()
    except OSError:
        pytest.skip("/run is not writable here")
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(str(folder / "service.sock"))
        listener.listen()
        sol = plant(defn, tmp_path / "planted", "dialer", SOCKET_DIALER.format(path=str(folder / "service.sock")))
        [result] = judge(defn, sol, one)
    finally:
        listener.close()
        shutil.rmtree(folder)
    assert result.status == runner.PASSED, result.log

SECRET_READER = """
from flush import run as flush

SECRET, PATHS = {secret!r}, {paths!r}


def run(*x):
    for path in PATHS:
        try:
            with open(path, "rb") as f:
                seen = f.read()
        except OSError:
            continue
        if SECRET in seen:
            raise RuntimeError(f"read {{path}}: {{seen!r}}")
    return flush(*x)
"""


@needs_sandbox
def test_files_the_host_keeps_private_and_folders_beyond_the_system_are_out_of_reach(defn, one, tmp_path):
    """The harness often runs as root, and the worker is that user in its namespace: a file in /etc that only its
    owner may read (like /etc/shadow), a file in a folder others cannot enter, and any file outside the system
    folders (/var, a second root, a data disk) would be readable, and an exception carries what it read into the
    run's table and the traces."""
    tag = f"harness-test-{uuid.uuid4().hex}"
    secret = uuid.uuid4().hex.encode()
    private_file, private_dir, outside = Path("/etc") / tag, Path("/etc") / f"{tag}.d", Path("/var") / tag
    try:
        private_dir.mkdir(mode=0o700)
        outside.mkdir()
    except OSError:
        pytest.skip("/etc or /var is not writable here")
    try:
        private_file.write_bytes(secret)
        private_file.chmod(0o600)
        (private_dir / "key").write_bytes(secret)
        (private_dir / "key").chmod(0o644)
        (outside / "data").write_bytes(secret)
        paths = [str(private_file), str(private_dir / "key"), str(outside / "data")]
        sandbox._private_masks.cache_clear()            # /etc as it is now, with the files just made
        sol = plant(defn, tmp_path / "planted", "reader", SECRET_READER.format(secret=secret, paths=paths))
        [result] = judge(defn, sol, one)
    finally:
        private_file.unlink(missing_ok=True)
        shutil.rmtree(private_dir, ignore_errors=True)
        shutil.rmtree(outside, ignore_errors=True)
        sandbox._private_masks.cache_clear()
    assert result.status == runner.PASSED, result.log


REMOUNTER = ATTEMPT + """
import ctypes
import os

from flush import run as flush

MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
libc = ctypes.CDLL(None, use_errno=True)


def check(rc):
    if rc != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def make_writable(path):
    # a test: it writes nothing there, and puts the bind back as it was if the remount went through
    check(libc.mount(None, path.encode(), None, MS_REMOUNT | MS_BIND, None))
    libc.mount(None, path.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)


def nested_namespace():
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS))


def oom_score():
    with open("/proc/self/oom_score_adj") as f:
        if int(f.read()) != 1000:
            raise OSError(0, "oom_score_adj " + f.read())
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("-1000")


def run(*x):
    for path in ("/sandbox/lib/harness", "/sandbox/solution", "/etc"):
        attempt(f"remount {path}", lambda path=path: make_writable(path))
    attempt("unshare a user namespace", nested_namespace)
    attempt("lower the oom score", oom_score)
    return flush(*x)
"""


@needs_sandbox
def test_read_only_folders_cannot_be_remounted_and_the_worker_dies_first(defn, one, tmp_path):
    """Run as root, bwrap left the worker every capability of its user namespace: one mount() call made the
    read-only binds writable (the harness's own sources, /etc), and so would a nested user namespace. The
    worker is also what the kernel's out-of-memory killer takes first, and cannot change that."""
    before = snapshot(ROOT, ("harness",))
    [result] = judge(defn, plant(defn, tmp_path / "planted", "remounter", REMOUNTER), one)
    assert result.status == runner.PASSED, result.log
    tried = attempts("remounter")
    assert set(tried) == {"remount /sandbox/lib/harness", "remount /sandbox/solution", "remount /etc",
                          "unshare a user namespace", "lower the oom score"}, tried
    assert "done" not in tried.values(), tried
    assert tried["lower the oom score"] in ("EACCES", "EPERM"), tried        # it read 1000, then could not lower it
    assert snapshot(ROOT, ("harness",)) == before


# 3. A detached process that outlives the worker -----------------------------------------------------------------

DAEMON = '''
import os, sys, time
marker, worker, *targets = sys.argv[1:]     # the marker only labels this process for the test to find
with open(os.path.expanduser("~/daemon.pid"), "w") as f:
    f.write(str(os.getpid()))
while True:
    try:
        os.kill(int(worker), 0)
    except ProcessLookupError:
        break
    time.sleep(0.02)
time.sleep(1)            # the harness has moved on by now, to judge someone else
for target in targets:
    try:
        with open(os.path.expanduser(target), "w") as f:
            f.write('{"solution": "daemon", "evaluation": {"status": "PASSED"}}\\n')
    except OSError:
        pass
time.sleep(600)
'''

DETACHER = '''
import os
import sys

from flush import run as flush

DAEMON, MARKER, FORGED = {daemon!r}, {marker!r}, {forged!r}


def run(*x):
    worker = str(os.getpid())
    child = os.fork()
    if child == 0:              # a new session, then a grandchild that nobody waits for
        os.setsid()
        if os.fork() == 0:
            try:
                os.execv(sys.executable, [sys.executable, "-c", DAEMON, MARKER, worker, FORGED, "~/forged.jsonl"])
            finally:
                os._exit(1)
        os._exit(0)
    os.waitpid(child, 0)
    return flush(*x)
'''


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            pass                # ended meanwhile
    return found


@needs_sandbox
def test_a_detached_process_dies_with_the_worker(defn, one, tmp_path):
    marker, forged = f"planted-daemon-{uuid.uuid4().hex}", tmp_path / "forged_trace.jsonl"
    code = DETACHER.format(daemon=DAEMON, marker=marker, forged=str(forged))
    sol = plant(defn, tmp_path / "planted", "detacher", code)
    [result] = judge(defn, sol, one)
    assert result.status == runner.PASSED, result.log
    assert_honest_passes(defn, one)           # long enough for the daemon to have written, had it lived
    deadline = time.monotonic() + 3
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = processes_with(marker)
    for pid in survivors:
        os.kill(pid, 9)
    assert not survivors
    home = home_of("detacher")
    assert (home / "daemon.pid").exists()     # it did start
    assert not (home / "forged.jsonl").exists() and not forged.exists()



@needs_sandbox
def test_the_worker_is_gone_only_when_its_pid_namespace_is(tmp_path, monkeypatch):
    """wait_gone reports a live namespace (a process in a session of its own inside it) as not gone, and the same
    namespace as gone at once after the kill."""
    monkeypatch.setattr(sandbox, "GONE_TIMEOUT_S", 0.5)
    files = [("solution.json", b"{}")]
    box = sandbox.Sandbox("gone", files, sandbox.files_sha256(files), [ROOT], {})
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(60)"
    proc = box.popen(["-c", code], pass_fds=())
    try:
        assert box.init_pid is not None
        assert not box.wait_gone()
        os.killpg(proc.pid, 9)
        proc.wait()
        start = time.monotonic()
        assert box.wait_gone()
        assert time.monotonic() - start < 0.5
    finally:
        box.close()


def fake_driver(tmp_path: Path, gpus: dict[str, int]) -> tuple[Path, Path]:
    """A /dev and a /proc/driver/nvidia/gpus as the driver lays them out, for GPUs {uuid: minor}."""
    dev, proc = tmp_path / "dev", tmp_path / "gpus"
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps", *(f"nvidia{m}" for m in gpus.values())):
        (dev / name).mkdir(parents=True)
    for i, (uuid, minor) in enumerate(gpus.items()):
        (proc / f"0000:{i:02x}:00.0").mkdir(parents=True)
        (proc / f"0000:{i:02x}:00.0" / "information").write_text(
            f"Model: \t\t NVIDIA H100\nIRQ: \t\t 17\nGPU UUID: \t GPU-{uuid}\nBus Location: \t 0000:{i:02x}:00.0\n"
            f"Device Minor: \t {minor}\nGPU Excluded:\t No\n")
    return dev, proc


def test_a_worker_is_given_its_own_gpu_node_and_no_other(tmp_path):
    uuids = {"0a-11": 3, "0b-22": 0, "0c-33": 1}
    dev, proc = fake_driver(tmp_path, uuids)
    control = [str(dev / n) for n in ("nvidia-caps", "nvidia-uvm", "nvidia-uvm-tools", "nvidiactl")]
    for uuid, minor in uuids.items():
        assert sandbox.gpu_minor(f"GPU-{uuid.upper()}", proc) == minor
        nodes, note = sandbox.gpu_nodes(f"GPU-{uuid}", dev, proc)
        assert (sorted(nodes), note) == (sorted([*control, str(dev / f"nvidia{minor}")]), "")
    assert sandbox.gpu_nodes(None, dev, proc) == ([], "")           # a CPU run: no GPU at all
    nodes, note = sandbox.gpu_nodes("GPU-0d-44", dev, proc)          # unknown to the driver: said, not hidden
    assert len(nodes) == len(control) + 3 and "every GPU visible" in note


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@needs_sandbox
def test_the_sandboxed_worker_sees_exactly_its_gpu(tmp_path):
    files = [("solution.json", b"{}")]
    uuid = runner.gpu_uuid(None)
    box = sandbox.Sandbox("one-gpu", files, sandbox.files_sha256(files), [ROOT], {}, gpu=uuid)
    code = ("import glob, torch; print(torch.cuda.device_count(), 'GPU-' + str(torch.cuda.get_device_properties(0)"
            ".uuid), sorted(glob.glob('/dev/nvidia[0-9]*')))")
    proc = box.popen(["-c", code], pass_fds=())
    try:
        out = proc.communicate(timeout=120)[0].decode()
    finally:
        box.close()
    minor = sandbox.gpu_minor(uuid)
    assert box.gpu_note == "" and minor is not None, box.gpu_note
    assert out.split(" ", 2) == ["1", uuid, f"['/dev/nvidia{minor}']\n"], out

# 4. A forged judge: bytecode planted beside the operator module, the definition edited ----------------------------

JUDGE = "harness/ops/leapquant_kda_flush/criterion.py"

FORGER = '''
import hashlib
import importlib.util
import marshal
import struct

from flush import run as flush

REPO, MARKER = {repo!r}, {marker!r}
PACKAGE_ROOTS = ["/sandbox/lib", {host_root!r}]     # where the worker imports the harness from; where the harness does
JUDGE, DEFINITION = {judge!r}, {definition!r}


def forged_pyc(source_path):
    """The judge's own code with one line in front, stamped with its source's mtime and size, so that the default
    import machinery takes it for the judge's cache."""
    with open(source_path) as f:
        source = f.read()
    code = compile(f"open({{MARKER!r}}, 'w').close()\\n" + source, source_path, "exec")
    st = os.stat(source_path)
    stamp = struct.pack("<III", 0, int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)
    return importlib.util.MAGIC_NUMBER + stamp + marshal.dumps(code)


def plant_pyc(package_root):
    source = os.path.join(package_root, JUDGE)
    pyc = importlib.util.cache_from_source(source)
    os.makedirs(os.path.dirname(pyc), exist_ok=True)
    with open(pyc, "wb") as f:
        f.write(forged_pyc(source))


def loosen_definition():
    """A looser criterion in the definition, and its pinned hash to match."""
    path = os.path.join(REPO, "definitions", DEFINITION)
    with open(path) as f:
        text = f.read().replace("1.01", "100.0")
    with open(path, "w") as f:
        f.write(text)
    with open(os.path.join(REPO, "definitions", "SHA256SUMS"), "w") as f:
        f.write(f"{{hashlib.sha256(text.encode()).hexdigest()}}  {{DEFINITION}}\\n")


def run(*x):
    for root in PACKAGE_ROOTS:
        attempt(f"plant a pyc under {{root}}", lambda root=root: plant_pyc(root))
    attempt("loosen the definition", loosen_definition)
    return flush(*x)
'''


@needs_sandbox
def test_the_judge_and_the_definition_cannot_be_replaced(repo, monkeypatch, tmp_path):
    marker = tmp_path / "forged_judge_ran"
    host_cache = Path(importlib.util.cache_from_source(str(ROOT / JUDGE))).parent
    existed = host_cache.exists()
    before, cached = snapshot(repo), {p: p.read_bytes() for p in host_cache.glob("*")}
    [definition] = [rel for rel in before if rel.endswith(f"{DEFINITION}.json")]
    code = ATTEMPT + FORGER.format(repo=str(repo), marker=str(marker), judge=JUDGE,
                                   host_root=str(sandbox.HARNESS_PACKAGE.parent),
                                   definition=str(Path(definition).relative_to("definitions")))
    make_solution(repo / "solutions", "forger", code)
    try:
        exit_code, results = run_cli(monkeypatch, repo, "forger", HONEST)
        after = {p: p.read_bytes() for p in host_cache.glob("*")}
    finally:        # had it got through, the real repository's cache is put back as it was
        for p in set(host_cache.glob("*")) - set(cached):
            p.unlink()
        if not existed and host_cache.exists():
            host_cache.rmdir()
    assert [(r.solution, r.status) for r in results] == [("forger", runner.PASSED), (HONEST, runner.PASSED)]
    assert exit_code == 0
    assert after == cached and snapshot(repo) == before and not marker.exists()
    tried = attempts("forger")
    assert len(tried) == 3 and "done" not in tried.values(), tried


def test_harness_imports_ignore_a_planted_pyc(tmp_path):
    """harness/__init__.py compiles harness.* from source: a .pyc planted in __pycache__ with the source's mtime and
    size, which the default machinery accepts (the control import shows it), is not used."""
    copy = tmp_path / "lib"
    shutil.copytree(sandbox.HARNESS_PACKAGE, copy / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    source = copy / "harness" / "planted.py"
    source.write_text("VALUE = 'source'\n")
    code = compile("VALUE = 'forged'\n", str(source), "exec")
    st = source.stat()
    pyc = Path(importlib.util.cache_from_source(str(source)))
    pyc.parent.mkdir()
    pyc.write_bytes(importlib.util.MAGIC_NUMBER + struct.pack("<III", 0, int(st.st_mtime) & 0xFFFFFFFF, st.st_size)
                    + marshal.dumps(code))
    probe = ("import importlib.util, harness, harness.planted\n"
             f"assert harness.__file__ == {str(copy / 'harness' / '__init__.py')!r}, harness.__file__\n"
             f"spec = importlib.util.spec_from_file_location('control', {str(source)!r})\n"
             "control = importlib.util.module_from_spec(spec)\n"
             "spec.loader.exec_module(control)\n"
             "print(harness.planted.VALUE, control.VALUE)\n")
    # -S and cwd: neither the editable install's finder nor the current directory (first on sys.path) can serve the
    # repository's harness instead of the copy
    done = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["source", "forged"]


# 5. Overwrite its own sources --------------------------------------------------------------------------------------

OVERWRITER = '''
import atexit

from flush import run as flush

ORIGINAL = {original!r}        # the folder the sources were submitted from


def overwrite(path):
    with open(path, "w") as f:
        f.write("from flush import run\\n")


def overwrite_sources():
    attempt("overwrite __file__", lambda: overwrite(__file__))
    for path in ("/sandbox/solution/main.py", "/sandbox/solution/flush.py", "/sandbox/solution/solution.json",
                 os.path.join(ORIGINAL, "main.py")):
        attempt(f"overwrite {{path}}", lambda path=path: overwrite(path))
    attempt("make itself writable", lambda: os.chmod(__file__, 0o666))
    attempt("swap a file in for itself", lambda: os.rename("/sandbox/solution/flush.py", __file__))
    attempt("delete itself", lambda: os.unlink(__file__))


atexit.register(overwrite_sources)      # on the way out too, in case the harness hashes the sources after the run


def run(*x):
    out = flush(*x)
    overwrite_sources()
    return out
'''


@needs_sandbox
def test_sources_cannot_be_overwritten_and_the_recorded_hash_is_theirs(defn, one, tmp_path):
    folder = tmp_path / "planted"
    sol = plant(defn, folder, "overwriter", ATTEMPT + OVERWRITER.format(original=str(folder / "overwriter")))
    files = {p: p.read_bytes() for p in (folder / "overwriter").iterdir()}
    sha256 = source_sha256(sol, defn)
    [result] = judge(defn, sol, one)
    assert result.status == runner.PASSED, result.log
    assert result.sha256 == sha256 == source_sha256(sol, defn)
    assert {p: p.read_bytes() for p in (folder / "overwriter").iterdir()} == files
    tried = attempts("overwriter")
    assert len(tried) == 8 and "done" not in tried.values(), tried
    assert_honest_passes(defn, one)


# 6. Import a file that solution.json does not list ----------------------------------------------------------------

UNLISTED = {
    "at import": ("from helper import run\n", runner.COMPILE_ERROR),
    "inside run": ("def run(*x):\n    from helper import run as flush\n    return flush(*x)\n", runner.RUNTIME_ERROR),
}


@needs_sandbox
@pytest.mark.parametrize("case", UNLISTED)
def test_an_unlisted_sibling_is_not_there(defn, one, tmp_path, case):
    code, status = UNLISTED[case]
    folder = make_solution(tmp_path / "planted", "unlisted", code, copy_flush=False)
    shutil.copy(ROOT / "solutions" / HONEST / "flush.py", folder / "helper.py")      # beside it, not in its sources
    [result] = judge(defn, load_solution("unlisted", defn, tmp_path / "planted"), one)
    assert result.status == status and "No module named 'helper'" in result.log, (result.status, result.log)
    assert one_line(result.log)
    assert_honest_passes(defn, one)


# 7. Forged messages, written straight to the worker's socket ------------------------------------------------------

FORGED_REPLY = '''
import fcntl
import json
import os
import pickle
import socket
import struct
import sys
import time

MARKER, N_OUTPUTS = {marker!r}, {n_outputs}
HARNESS = socket.socket(fileno=os.dup(int(sys.argv[1])))      # the worker is `python -m harness.worker FD`


class Payload:
    """Runs a command wherever it is unpickled."""
    def __reduce__(self):
        return os.system, (f"touch {{MARKER}}",)


def frame(body):
    return struct.pack("<Q", len(body)) + body


def sealed_memfd(size):
    fd = os.memfd_create("reply", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                | fcntl.F_SEAL_WRITE)
    return fd


def file_in_home(size):
    path = os.path.expanduser("~/reply.bin")
    with open(path, "wb") as f:
        f.write(bytes(size))
    return os.open(path, os.O_RDONLY)


def reply(first_output, fd):
    """A reply to "run" whose first output is `first_output` (dtype, shape) in the file `fd`."""
    body = json.dumps({{"status": "ok", "outputs": [{{"kind": "tensor", "device": "cpu"}}] * N_OUTPUTS,
                       "tensors": [{{"name": "out0", "offset": 0, **first_output}}]}}).encode()
    socket.send_fds(HARNESS, [frame(body)], [fd])


def gone():
    """Exit without a reply of its own: the harness has only the forged message to go on."""
    os._exit(0)


def stay():
    """Stay alive and silent: the harness has to end it."""
    time.sleep(600)


def run(*x):
    {attack}
'''

PROTOCOL = {
    "pickle": ("HARNESS.sendall(frame(pickle.dumps(Payload()))); gone()", runner.RUNTIME_ERROR,
               "malformed reply while running: message is not JSON"),
    "stall after the length": ("HARNESS.sendall(struct.pack('<Q', 1000)); stay()", runner.TIMEOUT,
                               f"no answer within {HANG_TIMEOUT_S:g} s while running"),
    "garbage": ("HARNESS.sendall(bytes.fromhex('deadbeef') * 64); gone()", runner.RUNTIME_ERROR,
                "malformed reply while running: message header of"),
    "huge shape": ("reply({'dtype': 'float32', 'shape': [1 << 20, 1 << 19]}, sealed_memfd(4096)); gone()",
                   runner.RUNTIME_ERROR, "limit"),
    "wrong dtype": ("reply({'dtype': 'bool', 'shape': [64]}, sealed_memfd(4096)); gone()", runner.RUNTIME_ERROR,
                    "has dtype 'bool'"),
    "pipe": ("reply({'dtype': 'int8', 'shape': [64]}, os.pipe()[0]); gone()", runner.RUNTIME_ERROR,
             "not a regular file"),
    "regular file": ("reply({'dtype': 'int8', 'shape': [64]}, file_in_home(4096)); gone()", runner.RUNTIME_ERROR,
                     "not a sealed memfd"),
    # the worker is alive but its end is closed: the harness must not wait for it to exit
    "socket shut down": ("HARNESS.shutdown(socket.SHUT_RDWR); stay()", runner.RUNTIME_ERROR, "worker process died"),
    "error message of several lines": (
        "HARNESS.sendall(frame(json.dumps({'status': 'error', 'tensors': [], "
        "'message': 'boom\\n  a forged second line\\n  and a third'}).encode())); gone()",
        runner.RUNTIME_ERROR, "boom a forged second line"),
}


@needs_sandbox
@pytest.mark.parametrize("attack, status, says", [
    *(pytest.param(*PROTOCOL[name], id=name) for name in PROTOCOL),
])
def test_a_forged_message_is_refused(defn, one, tmp_path, attack, status, says):
    marker = tmp_path / "unpickled"
    code = FORGED_REPLY.format(marker=str(marker), n_outputs=len(defn.outputs), attack=attack)
    t0 = time.monotonic()
    [result] = judge(defn, plant(defn, tmp_path / "planted", "forger", code), one, timeout_s=HANG_TIMEOUT_S)
    assert time.monotonic() - t0 < HANG_TIMEOUT_S + 10       # load, one deadline, stop: no hang
    assert result.status == status and says in result.log, (result.status, result.log)
    assert one_line(result.log)
    assert not marker.exists()
    assert_honest_passes(defn, one)


# A reply larger than what was asked: a sealed memfd that costs its sender nothing (only truncated to its size),
# sent at import as the answer to the load message
HUGE_READY = '''
import fcntl, json, os, socket, struct, sys
from flush import run

SIZE = 1 << 30
sock = socket.socket(fileno=int(sys.argv[1]))
fd = os.memfd_create("wire", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
os.ftruncate(fd, SIZE)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
body = json.dumps({"status": "ready", "tensors": [{"name": "x", "dtype": "uint8", "shape": [SIZE], "offset": 0}]})
socket.send_fds(sock, [struct.pack("<Q", len(body)) + body.encode()], [fd])
sock.detach()
'''


@needs_sandbox
def test_a_reply_larger_than_asked_for_is_refused_unread(defn, one, tmp_path):
    sol = plant(defn, tmp_path / "planted", "huge_ready", HUGE_READY)
    Path("/proc/self/clear_refs").write_text("5")
    start = peak_rss_mb()
    [result] = judge(defn, sol, one)
    assert result.status == runner.COMPILE_ERROR and "(limit 0)" in result.log, (result.status, result.log)
    assert one_line(result.log) and peak_rss_mb() - start < 64
    assert_honest_passes(defn, one)


# 8. Outputs that are not plain dense tensors ------------------------------------------------------------------------

IMPOSTOR_OUTPUTS = {
    "tensor subclass": ('''
import torch

from flush import run as flush


class PlainTensor(torch.Tensor):
    """Passes for a plain tensor to isinstance and __class__."""
    @property
    def __class__(self):
        return torch.Tensor


def run(*x):
    out = flush(*x)
    return (out[0].as_subclass(PlainTensor),) + out[1:]
''', "codes_new is a PlainTensor, not a plain dense tensor"),
    "sparse tensor": ('''
from flush import run as flush


def run(*x):
    out = flush(*x)
    return (out[0].to_sparse(),) + out[1:]
''', "codes_new is a tensor with layout torch.sparse_coo, not a plain dense tensor"),
}


@needs_sandbox
@pytest.mark.parametrize("case", IMPOSTOR_OUTPUTS)
def test_an_output_that_is_not_a_plain_tensor_is_refused(defn, one, tmp_path, case):
    code, says = IMPOSTOR_OUTPUTS[case]
    [result] = judge(defn, plant(defn, tmp_path / "planted", "impostor", code), one)
    assert result.status == runner.INCORRECT_SHAPE and says in result.log, (result.status, result.log)
    assert one_line(result.log)
    assert_honest_passes(defn, one)


# 9. Hang ------------------------------------------------------------------------------------------------------------

@needs_sandbox
def test_a_hang_costs_one_timeout_and_stops_the_solution(defn, one, tmp_path):
    workloads = select(load_workloads(defn, PROJECT.workload_file(defn)), [1], None)
    sol = plant(defn, tmp_path / "planted", "sleeper", "import time\n\n\ndef run(*x):\n    time.sleep(600)\n")
    t0 = time.monotonic()
    results = judge(defn, sol, workloads, timeout_s=HANG_TIMEOUT_S)
    elapsed = time.monotonic() - t0
    assert len(results) == len(workloads) and [r.status for r in results] == [runner.TIMEOUT] * len(workloads)
    assert results[0].log == f"no answer within {HANG_TIMEOUT_S:g} s while running; worker killed"
    stopped = f"not run: the worker was stopped on {results[0].workload.label} ({results[0].log})"
    assert all(r.log == stopped for r in results[1:]), results[1].log
    assert elapsed < (len(workloads) - 1) * HANG_TIMEOUT_S, elapsed      # one timeout (and start, stop), not four
    assert_honest_passes(defn, one)


HANGS_ONCE = '''
import os
import time

from flush import run as flush

HUNG = os.path.expanduser("~/hung")        # the home outlives the worker


def run(*x):
    if not os.path.exists(HUNG):
        open(HUNG, "w").close()
        time.sleep(600)
    return flush(*x)
'''


@needs_sandbox
def test_keep_going_runs_the_remaining_workloads(defn, tmp_path):
    """After the timeout a fresh worker (same sources, same home) runs the next workload."""
    workloads = select(load_workloads(defn, PROJECT.workload_file(defn)), [1], ["random", "edge"])
    sol = plant(defn, tmp_path / "planted", "hangs_once", HANGS_ONCE)
    results = judge(defn, sol, workloads, timeout_s=HANG_TIMEOUT_S, keep_going=True)
    assert [r.status for r in results] == [runner.TIMEOUT, runner.PASSED], [r.log for r in results]


# 10. Flood the output and the disk ---------------------------------------------------------------------------------

FLOODER = '''
import os
import sys

from flush import run as flush


def run(*x):
    line = "x" * 999 + "\\n"
    for _ in range(20_000):             # 20 MB to each of stdout and stderr
        sys.stdout.write(line)
        sys.stderr.write(line)
    with open(os.path.expanduser("~/ballast.bin"), "wb") as f:
        for _ in range(200):
            f.write(bytes(1 << 20))
    return flush(*x)
'''


@needs_sandbox
def test_flooding_the_output_and_the_home_changes_nothing(defn, one, tmp_path):
    t0 = time.monotonic()
    [result] = judge(defn, plant(defn, tmp_path / "planted", "flooder", FLOODER), one)
    assert result.status == runner.PASSED, result.log
    assert time.monotonic() - t0 < TIMEOUT_S
    ballast = home_of("flooder") / "ballast.bin"
    assert ballast.stat().st_size == 200 << 20
    ballast.unlink()
    assert_honest_passes(defn, one)


@needs_sandbox
def test_a_home_left_too_large_is_deleted_and_older_homes_are_pruned(defn, one, tmp_path, monkeypatch):
    """The home is the one place a solution writes that outlives its worker: ballast left there must not fill the
    disk for every later run, and the homes of a solution's earlier sources are removed when it runs again."""
    monkeypatch.setattr(sandbox, "HOME_BYTES", 100 << 20)
    monkeypatch.setattr(sandbox, "HOME_CHECK_S", 1e6)         # not measured while it runs: left behind
    sol = plant(defn, tmp_path / "planted", "flooder", FLOODER)
    stale = sandbox.cache_root() / "home" / f"{runner.home_name(sol)}-0123456789abcdef"
    elsewhere = sandbox.cache_root() / "home" / "flooder@00000000-0123456789abcdef"    # another project's flooder
    stale.mkdir(parents=True)
    elsewhere.mkdir(parents=True, exist_ok=True)
    [result] = judge(defn, sol, one)
    assert result.status == runner.PASSED, result.log
    assert list((sandbox.cache_root() / "home").glob(f"{runner.home_name(sol)}-*")) == []
    assert elsewhere.is_dir()
    elsewhere.rmdir()



@needs_sandbox
def test_a_home_that_grows_too_large_ends_the_worker_at_once(defn, one, tmp_path, monkeypatch):
    """The home lies on the host's disk: one that grows past the limit while the worker runs (here it goes on
    writing) ends it then, not when it is done, and is deleted."""
    monkeypatch.setattr(sandbox, "HOME_BYTES", 50 << 20)
    monkeypatch.setattr(sandbox, "HOME_CHECK_S", 0.2)
    filler = FLOODER.replace("range(200)", "range(1000)").replace("range(20_000)", "range(0)")
    sol = plant(defn, tmp_path / "planted", "filler", filler)
    start = time.monotonic()
    [result] = judge(defn, sol, one)
    assert result.status == runner.RUNTIME_ERROR and "its home grew past 50 MiB" in result.log, result.log
    assert time.monotonic() - start < 60
    assert list((sandbox.cache_root() / "home").glob(f"{runner.home_name(sol)}-*")) == []


INODE_FLOODER = """
import os

from flush import run as flush


def run(*x):
    folder = os.path.expanduser("~/empty")
    os.makedirs(folder, exist_ok=True)
    for i in range(3000):              # no bytes at all, but every one takes an inode of the host's disk
        open(os.path.join(folder, str(i)), "w").close()
    return flush(*x)
"""


@needs_sandbox
def test_a_home_of_too_many_empty_files_is_deleted(defn, one, tmp_path, monkeypatch):
    """Empty files and folders weigh nothing and still use up the disk's inodes: the home's entries are counted."""
    monkeypatch.setattr(sandbox, "HOME_ENTRIES", 1000)
    monkeypatch.setattr(sandbox, "HOME_CHECK_S", 1e6)         # not measured while it runs: left behind
    sol = plant(defn, tmp_path / "planted", "inodes", INODE_FLOODER)
    [result] = judge(defn, sol, one)
    assert result.status == runner.PASSED, result.log
    assert list((sandbox.cache_root() / "home").glob(f"{runner.home_name(sol)}-*")) == []


def test_a_home_in_use_is_not_pruned_by_another_run():
    """Two runs on one machine with different sources of one solution (two branches in CI): each keeps its home
    while its sandbox exists; the later prunes the earlier's only once it is unused."""
    def box(source: bytes) -> sandbox.Sandbox:
        files = [("solution.json", source)]
        return sandbox.Sandbox("shared", files, sandbox.files_sha256(files), [ROOT], {})
    first = box(b"{}")
    second = box(b"{ }")
    assert first.home.is_dir() and second.home.is_dir()
    first.close()
    third = box(b"{  }")
    assert not first.home.exists() and second.home.is_dir() and third.home.is_dir()
    second.close()
    third.close()

DEEP_HOME = '''
import os
from flush import run as flush

_here = os.getcwd()
os.chdir(os.path.expanduser("~"))
for _ in range(1500):           # deeper than Python's recursion limit
    os.makedirs("d", exist_ok=True)
    os.chdir("d")
with open("bottom", "wb") as f:
    f.write(bytes(2 << 20))
os.chdir(_here)


def run(*x):
    return flush(*x)
'''


@needs_sandbox
def test_a_home_deeper_than_the_recursion_limit_is_measured_and_removed(defn, one, tmp_path, monkeypatch):
    """The 2 MiB file at the bottom is counted (a recursive walk would stop short and count nothing), so the
    home is over the limit after the run and removed; measured only then (the watch during the run is held off)."""
    monkeypatch.setattr(sandbox, "HOME_BYTES", 1 << 20)
    monkeypatch.setattr(sandbox, "HOME_CHECK_S", 3600.0)
    sol = plant(defn, tmp_path / "planted", "deep_home", DEEP_HOME)
    [result] = judge(defn, sol, one)
    assert result.status == runner.PASSED, result.log
    assert list((sandbox.cache_root() / "home").glob(f"{runner.home_name(sol)}-*")) == []


def peak_rss_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) / 1024


@needs_sandbox
def test_an_endless_line_of_output_does_not_grow_the_harness(defn, one, tmp_path):
    code = "import sys\nfrom flush import run as flush\n\n\ndef run(*x):\n" \
           "    sys.stdout.write('x' * (128 << 20))\n    return flush(*x)\n"
    sol = plant(defn, tmp_path / "planted", "endless_line", code)
    Path("/proc/self/clear_refs").write_text("5")         # the peak restarts from the current size
    start = peak_rss_mb()
    [result] = judge(defn, sol, one)
    assert result.status == runner.PASSED, result.log
    assert peak_rss_mb() - start < 64
