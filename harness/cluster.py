"""harness.run's jobs on a Ray cluster (`--ray auto|ADDRESS`; `pip install -e ".[cluster]"`). Each job is a Ray task
that holds one whole GPU (`num_gpus=1`; one CPU on a cluster without GPUs) and evaluates one share of a solution's
workloads exactly as the local runner does (harness.runner.evaluate: the sandboxed worker, the judge, the clock),
on the node's copy of the project: a shared file system, or the same checkout at the same path on every node. The
results come back to the driver, which writes the traces as a local run does. Ray schedules and places the jobs;
nothing here queues, retries or speaks to the nodes itself. A job that fails as a whole (its node lost) becomes a
RUNTIME_ERROR of its workloads, never a lost run."""
from __future__ import annotations

import socket
from pathlib import Path

from harness import HarnessError
from harness.project import Project, Settings
from harness.runner import RUNTIME_ERROR, Result, deal


def _ray():
    try:
        import ray
    except ImportError:
        raise HarnessError("--ray needs Ray: pip install -e \".[cluster]\"") from None
    return ray


def connect(address: str) -> tuple[str, int, dict]:
    """Join the cluster at `address` ("auto": the one this machine belongs to; an instance this process started
    already is used as it is): (device kind, job slots: its GPUs, else its CPUs, environment of a slot's hardware
    as harness.traces.environment gives it)."""
    ray = _ray()
    if not ray.is_initialized():
        _answers(address)
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise HarnessError(f"--ray {address}: {' '.join(str(e).split())[:200]}") from None
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    device, slots = ("cuda", gpus) if gpus else ("cpu", cpus)
    if slots < 1:
        raise HarnessError(f"--ray {address}: the cluster offers no GPU and no CPU")
    env = ray.get(_task(ray, device).remote(_environment, device))
    return device, slots, env


def _answers(address: str, timeout_s: float = 5.0) -> None:
    """A HOST:PORT address must accept a connection before Ray is asked to join it: Ray waits minutes on one where
    nothing answers."""
    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise HarnessError(f"--ray {address}: give 'auto' or HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise HarnessError(f"--ray {address}: nothing answers there ({e.strerror or type(e).__name__})") from None


def _task(ray, device: str):
    """A Ray task that holds one whole GPU (or one CPU)."""
    return ray.remote(num_gpus=1, num_cpus=0)(_call) if device == "cuda" else ray.remote(num_cpus=1)(_call)


def _call(fn, *args):
    return fn(*args)


def _environment(device: str) -> dict:
    from harness import traces
    return traces.environment(device)


def _evaluate_share(project_root: str, definition: str, solutions_root: str, solution: str, workload_file: str,
                    uuids: list[str], device: str, settings: Settings, run_seed: int, timed: bool,
                    keep_going: bool) -> list[Result]:
    """One job, on a node: the share `uuids` of the workloads, evaluated as harness.run evaluates them locally."""
    from harness.definition import find_definition
    from harness.runner import evaluate
    from harness.solutions import load_solution
    from harness.workloads import load_workloads

    project = Project.at(project_root)
    defn = find_definition(definition, project.definitions)
    sol = load_solution(solution, defn, solutions_root)
    by_uuid = {w.uuid: w for w in load_workloads(defn, workload_file)}
    return evaluate(defn, sol, [by_uuid[u] for u in uuids], device, root=project.root, settings=settings,
                    hide=(project.root,), timed=timed, run_seed=run_seed, keep_going=keep_going)


def evaluate_on_cluster(slots: int, project: Project, defn, sol, todo: list, device: str, workload_file: Path,
                        settings: Settings, run_seed: int, timed: bool, keep_going: bool, on_result) -> list[Result]:
    """evaluate() of `todo` dealt into up to `slots` jobs on the cluster, the results in the order of `todo`,
    each reported to `on_result` as its job ends."""
    ray = _ray()
    task = _task(ray, device)
    pending = {task.remote(_evaluate_share, str(project.root), defn.name, str(project.solutions), sol.name,
                           str(workload_file), [w.uuid for w in share], device, settings, run_seed, timed,
                           keep_going): share
               for share in deal(todo, slots)}
    done: dict[str, Result] = {}
    while pending:
        [ready], _ = ray.wait(list(pending), num_returns=1)
        share = pending.pop(ready)
        try:
            results = ray.get(ready)
        except Exception as e:  # noqa: BLE001 - a job lost as a whole is its workloads' status, the others go on
            why = " ".join(f"the cluster job failed: {type(e).__name__}: {e}".split())[:400]
            results = [Result(sol.name, w, RUNTIME_ERROR, log=why) for w in share]
        for r in results:
            done[r.workload.uuid] = r
            on_result(r)
    return [done[w.uuid] for w in todo]
