"""harness.project: a project is found from any folder inside it (else it is the harness's own checkout), names every
path a command uses, and one Settings object carries the figures of a run, refused when they make no sense."""
import errno
import os

import pytest

from conftest import PROJECT, ROOT
from harness.definition import DefinitionError, project_definition
from harness.project import Project, ProjectError, Settings, write_file


def test_found_from_any_folder_inside_it_and_from_outside_any(tmp_path):
    assert Project.find(ROOT / "solutions" / "torch_v1") == PROJECT
    (tmp_path / "definitions").mkdir()
    (tmp_path / "deep" / "er").mkdir(parents=True)
    assert Project.find(tmp_path / "deep" / "er").root == tmp_path.resolve()
    outside = tmp_path / "deep"
    (tmp_path / "definitions").rmdir()
    assert Project.find(outside) == PROJECT                 # the checkout the harness is imported from


def test_paths_come_from_the_root(defn):
    assert PROJECT.definitions == ROOT / "definitions" and PROJECT.solutions == ROOT / "solutions"
    assert PROJECT.traces == ROOT / "traces" and PROJECT.leaderboard == ROOT / "LEADERBOARD.md"
    assert PROJECT.workload_file(defn) == ROOT / "workloads" / defn.op_type / f"{defn.name}.jsonl"
    assert PROJECT.workload_file(defn).is_file() and PROJECT.leaderboard.is_file()


def test_a_folder_without_definitions_is_not_a_project(tmp_path):
    with pytest.raises(ProjectError, match="not a project"):
        Project.at(tmp_path)


def test_the_default_definition_is_the_only_one(tmp_path, defn):
    assert project_definition(PROJECT).name == defn.name
    other = tmp_path / "definitions"
    other.mkdir()
    with pytest.raises(DefinitionError, match="not exactly one definition"):
        project_definition(Project.at(tmp_path))
    with pytest.raises(DefinitionError, match="no definition named 'nope'"):
        project_definition(PROJECT, "nope")


def test_settings_timed_calls_and_refusals():
    s = Settings(min_calls=20, max_calls=400, timed_programs=1 << 17)
    assert [s.timed_calls(n) for n in (32, 2048, 16384)] == [400, 64, 20]
    assert s.replace(timeout_s=5).timeout_s == 5 and s.timeout_s == Settings().timeout_s
    for bad in ({"timeout_s": 0}, {"warmup_replays": -1}, {"bandwidth": float("nan")}, {"max_calls": True},
                {"min_calls": 50, "max_calls": 10}):
        with pytest.raises(ProjectError):
            Settings(**bad)


def test_a_record_write_that_fails_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "traces" / "x.jsonl"
    write_file(path, "old\n")
    assert path.read_text() == "old\n"

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(ProjectError, match="x.jsonl: cannot be written .No space left on device."):
        write_file(path, "new\n")
    assert path.read_text() == "old\n" and sorted(p.name for p in path.parent.iterdir()) == ["x.jsonl"]
    with pytest.raises(ProjectError, match="cannot be written"):
        write_file(path / "below_a_file", "x")
