"""Elastic training with real elastic horovodrun jobs: workers killed, hosts leaving and joining, rank 0 lost,
and a job left with no usable host (what it says while it waits, and how it ends).

Hosts ``localhost`` and ``127.0.0.1`` are two hosts of one machine; the discovery script
(examples/elastic/discover_hosts_file.sh) prints a file the worker rewrites when it kills itself
(its host leaves) or when hosts should join. Every
worker appends its events to ``events.jsonl`` (tests/workers/elastic_training.py).
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest
from hvd_launch import REPO, WORKERS

from hvd_plugins.core.backend.build_marker import applied_patches
from hvd_plugins.testing.launch import JobResult, elastic_env, elastic_horovodrun, elastic_horovodrun_command

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins.core.backend.elastic",
    "hvd_plugins.core.backend.reset_wait",
    "hvd_plugins.core.elastic.attempts",
    "hvd_plugins.core.elastic.cursor",
    "hvd_plugins.core.elastic.epoch_split",
    "hvd_plugins.core.elastic.reset",
    "hvd_plugins.core.elastic.snapshot",
    "hvd_plugins.core.sync.sharded.replicas",
    "hvd_plugins.fabric.elastic",
    "hvd_plugins.pytorch.elastic",
    "hvd_plugins.pytorch.strategies.launchers.elastic",
)

pytestmark = pytest.mark.multiprocess

DISCOVERY = REPO / "examples" / "elastic" / "discover_hosts_file.sh"
SAMPLES = 480  # tests/workers/elastic_training.py
MAX_STEPS = 40


class ElasticJob:
    """One elastic launch of the test worker, and what its workers wrote."""

    def __init__(
        self, folder: Path, hosts_before: str, script: str = "elastic_training.py", mkdir: bool = False
    ) -> None:
        if mkdir:
            folder.mkdir(parents=True)
        self.folder = folder
        self.script = WORKERS / script
        self.hosts_file = folder / "hosts"
        self.hosts_file.write_text(hosts_before.replace(",", "\n") + "\n")
        self.result: JobResult | None = None

    def worker(self, np: int, *args: str) -> list[str]:
        worker = [sys.executable, str(self.script), "--out", str(self.folder), "--np-start", str(np)]
        return worker + ["--hosts-file", str(self.hosts_file), "--max-steps", str(MAX_STEPS), *args]

    def run(
        self,
        np: int,
        min_np: int,
        max_np: int,
        *args: str,
        timeout: float = 240,
        fails: bool = False,
        runner_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> ElasticJob:
        self.result = elastic_horovodrun(
            self.worker(np, *args),
            np=np,
            min_np=min_np,
            max_np=max_np,
            discovery_script=DISCOVERY,  # the example script, reading the file the workers rewrite
            env={"HOSTS_FILE": str(self.hosts_file), **(env or {})},
            timeout=timeout,
            runner_args=runner_args,
        )
        assert (self.result.returncode != 0) == fails, self.result.output[-6000:]
        return self

    def events(self, kind: str) -> list[dict[str, Any]]:
        lines = (self.folder / "events.jsonl").read_text().splitlines()
        return [event for event in map(json.loads, lines) if event["kind"] == kind]

    def ends(self) -> list[dict[str, Any]]:
        return sorted(self.events("end"), key=lambda event: event["rank"])

    def kept_batches(self) -> list[dict[str, Any]]:
        """Batches not rolled back: a batch trained before a reset counts only if it is older than the commit
        the reset went back to (the step the fit resumed at).

        A reset's resume is when its first worker started again: every batch before the reset was written
        before that, and a worker can write its first batch after it before a slower worker has logged its
        own start (a batch is logged before its first collective)."""
        resumed_at: dict[int, float] = {}
        for event in self.events("train_start"):
            if event["step"] > 0:
                resumed_at[event["step"]] = min(event["time"], resumed_at.get(event["step"], event["time"]))
        return [
            batch
            for batch in self.events("batch")
            if all(batch["time"] > time or batch["step"] < step for step, time in resumed_at.items())
        ]


def assert_one_finished_job(job: ElasticJob, workers: int) -> list[dict[str, Any]]:
    ends = job.ends()
    assert [end["rank"] for end in ends] == list(range(workers)), job.result.output[-4000:] if job.result else ""
    assert {end["size"] for end in ends} == {workers}
    assert {end["step"] for end in ends} == {MAX_STEPS}
    first = ends[0]["weights"]
    for end in ends[1:]:
        assert end["weights"] == first, f"rank {end['rank']} holds other weights than rank 0"
    return ends


def assert_epoch_trained_once(job: ElasticJob, epoch: int) -> None:
    """Every sample of ``epoch`` was trained exactly once by the batches that were kept (no padding here)."""
    counts = Counter(index for batch in job.kept_batches() if batch["epoch"] == epoch for index in batch["indices"])
    missing = sorted(set(range(SAMPLES)) - set(counts))
    twice = sorted(index for index, count in counts.items() if count > 1)
    assert not missing, f"{len(missing)} samples of epoch {epoch} were never trained, e.g. {missing[:10]}"
    assert not twice, f"{len(twice)} samples of epoch {epoch} were trained more than once, e.g. {twice[:10]}"


SHRINK = ("--kill-rank", "3", "--kill-step", "7")
"""4 workers on 2 hosts; rank 3 is killed in epoch 0 and its host leaves with its other worker."""


@pytest.fixture(scope="module")
def unsharded_shrink(tmp_path_factory: pytest.TempPathFactory) -> ElasticJob:
    return ElasticJob(tmp_path_factory.mktemp("shrink"), "localhost:2,127.0.0.1:2").run(4, 2, 4, *SHRINK)


def test_a_killed_worker_and_its_host_leave_and_the_fit_goes_on(unsharded_shrink: ElasticJob) -> None:
    """4 workers on 2 hosts; rank 3 is killed in epoch 0 and its host leaves: 2 workers finish the same fit."""
    job = unsharded_shrink
    ends = assert_one_finished_job(job, workers=2)
    assert {end["resets"] for end in ends} == {1}
    resets = job.events("reset")
    assert sorted((reset["old_size"], reset["new_size"]) for reset in resets) == [(4, 2), (4, 2)]
    resumed = {event["step"] for event in job.events("train_start") if event["step"] > 0}
    assert resumed == {5}, "the fit resumes at the last commit (every 5 steps), not from the start"
    assert_epoch_trained_once(job, epoch=0)
    (listening,) = job.events("listening")  # horovodrun's rendezvous, its workers' services, Gloo
    assert listening["addresses"] and all(a.startswith("127.") for a in listening["addresses"]), listening
    # scale_lr=True: learning rates follow the number of workers (StepLR's epoch decay does not reach 20 epochs)
    assert [end["lr"][0] for end in ends] == pytest.approx([0.01 * 2] * 2)


NO_HOST_TIMEOUT_S = 12
"""--elastic-timeout of the job left without a usable host: short, the suite stays fast."""
WAIT_REPORT_S = 5
RUNTIME_ERROR = "RuntimeError: "


def test_no_usable_host_left_the_job_says_why_while_it_waits_and_when_it_ends(tmp_path: Path) -> None:
    """4 workers on 2 hosts; rank 1 exits with status 1 while discovery drops the other host. Horovod blacklists
    the failed worker's host: no usable host is left. The job says that it waits, for what, and how long; at the
    elastic timeout every process ends non-zero and horovodrun's last error names the cause."""
    job = ElasticJob(tmp_path, "localhost:2,127.0.0.1:2").run(
        4, 2, 4, "--fail-rank", "1", "--kill-step", "7",
        fails=True,
        timeout=NO_HOST_TIMEOUT_S + 150,
        runner_args=("--elastic-timeout", str(NO_HOST_TIMEOUT_S)),
        env={"HOROVOD_ELASTIC_WAIT_REPORT_SECONDS": str(WAIT_REPORT_S)},
    )  # fmt: skip
    assert job.result is not None and not job.result.timed_out
    output = job.result.output
    assert not job.events("end"), "no worker finished the fit"
    (failed,) = job.events("failed")
    blacklisted = failed["host"]
    (removed,) = {"localhost", "127.0.0.1"} - {blacklisted}
    # the failed worker's exit is named (unanchored: horovodrun prints a line and its newline in two writes, and a
    # forwarded line can land between them). The workers stopped at the timeout end together, and horovodrun does
    # not always print each of their exits, nor their shells each "Terminated": what is checked for them is that
    # none outlived horovodrun.
    assert re.search(r"Process 1 exit with status code 1\.", output), output[-4000:]
    alive = [event["pid"] for event in job.events("train_start") if psutil.pid_exists(event["pid"])]
    assert not alive, f"workers outlived horovodrun: {alive}"
    # the job ended soon after the elastic timeout: the last failure and the timeout, then at most a few seconds
    assert job.result.seconds < NO_HOST_TIMEOUT_S + 120, f"{job.result.seconds:.0f} s"
    # the waiting workers said so, for how many workers and how long, at the start and then at intervals
    waiting = [line for line in output.splitlines() if "waiting for" in line and "hvd_plugins: elastic reset" in line]
    assert [line for line in waiting if "workers before; waiting for" in line], output[-4000:]
    assert [line for line in waiting if "still waiting for" in line], output[-4000:]
    if "0016-runner-elastic-wait-says-why" not in applied_patches():
        return  # another build: the workers said what they know, horovodrun says only Horovod's own words
    assert all("waiting for 2 workers (--min-np)" in line for line in waiting), waiting
    assert f"of the elastic timeout of {NO_HOST_TIMEOUT_S} s" in "\n".join(waiting)
    reports = [line for line in output.splitlines() if line.startswith("WARNING:root:Elastic job waiting for 2 slots")]
    assert len(reports) >= 2, output[-4000:]
    cause = f"{blacklisted}:2 blacklisted because rank 1 of 4 ({blacklisted}["
    assert cause in reports[0] and "exited with status 1" in reports[0], reports[0]
    assert f"Removed by discovery: {removed} (ranks" in reports[0], reports[0]
    last_error = [line for line in output.splitlines() if line.startswith(RUNTIME_ERROR)][-1]
    for said in (
        cause,
        "exited with status 1",
        f"Removed by discovery: {removed}",
        f"elastic timeout of {NO_HOST_TIMEOUT_S} s",
        "--elastic-timeout",
        "--blacklist-cooldown-range",
    ):
        assert said in last_error, f"{said!r} not in {last_error!r}"
    assert "{activity}" not in output


def test_a_sigterm_while_no_host_is_usable_ends_horovodrun_and_the_workers_at_once(tmp_path: Path) -> None:
    """The same job with a long elastic timeout, and horovodrun stopped by SIGTERM while it waits: the waiting
    workers end at once on every build, and horovodrun too with patch 0016 (it waited for the timeout)."""
    job = ElasticJob(tmp_path, "localhost:2,127.0.0.1:2")
    command = elastic_horovodrun_command(
        job.worker(4, "--fail-rank", "1", "--kill-step", "7"), 4, 2, 4, DISCOVERY, ("--elastic-timeout", "600")
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "HOSTS_FILE": str(job.hosts_file)}
    env["HOROVOD_ELASTIC_WAIT_REPORT_SECONDS"] = str(WAIT_REPORT_S)
    output = tmp_path / "output.txt"
    with output.open("w") as sink:
        runner = subprocess.Popen(command, env={**env, **elastic_env()}, stdout=sink, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while "still waiting for" not in output.read_text():  # a reset that waits, not one under way
            assert runner.poll() is None and time.monotonic() < deadline, output.read_text()[-4000:]
            time.sleep(0.5)
        waiting = [child for child in psutil.Process(runner.pid).children(recursive=True) if "elastic_training" in
                   " ".join(child.cmdline())]  # fmt: skip
        assert waiting, "no worker left to wait"
        runner.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        _, alive = psutil.wait_procs(waiting, timeout=10)
        assert not alive, f"workers still running 10 s after the SIGTERM: {alive}"
        if "0016-runner-elastic-wait-says-why" not in applied_patches():
            return  # another build's horovodrun notices the signal only at the elastic timeout
        returncode = runner.wait(timeout=10)
        assert returncode != 0 and time.monotonic() - stopped < 10
        text = output.read_text()
        last_error = [line for line in text.splitlines() if line.startswith(RUNTIME_ERROR)][-1]
        assert "Elastic job stopped by a signal" in last_error and "blacklisted because rank 1 of 4" in last_error
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()


def test_hosts_that_join_get_the_state_and_train_in_step(tmp_path: Path) -> None:
    """2 workers on 2 hosts of one slot; both hosts grow to 2 slots: the fit ends with 4 identical workers."""
    job = ElasticJob(tmp_path, "localhost:1,127.0.0.1:1").run(
        2, 2, 4, "--grow-step", "3", "--hosts-after", "localhost:2,127.0.0.1:2"
    )
    ends = assert_one_finished_job(job, workers=4)
    joined = [event for event in job.events("train_start") if event["size"] == 4]
    assert len(joined) == 4 and len({event["step"] for event in joined}) == 1, joined
    assert joined[0]["step"] > 0, "the workers that joined started from the commit, not from step 0"
    assert [end["lr"][0] for end in ends] == pytest.approx([0.01 * 4] * 4)


def test_rank_zero_killed_another_worker_logs_and_checkpoints(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, "localhost:1,127.0.0.1:1").run(2, 1, 2, "--kill-rank", "0", "--kill-step", "12")
    (end,) = assert_one_finished_job(job, workers=1)
    killed = job.events("killed")
    assert killed and killed[0]["rank"] == 0
    assert end["pid"] != killed[0]["pid"]
    log_dir = Path(end["log_dir"])
    assert log_dir.name == "version_0", "the new rank 0 logs on in the same folder"
    with (log_dir / "metrics.csv").open() as file:
        steps = [int(row["step"]) for row in csv.DictReader(file) if row.get("train_loss")]
    assert max(steps, default=-1) > killed[0]["step"] + 5, f"no metrics logged after rank 0 died: {steps}"
    saved = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    assert any(name.endswith(f"step={MAX_STEPS}.ckpt") for name in saved), saved


@pytest.mark.parametrize("sync", ["hierarchical", "daso"])
def test_node_aware_syncs_survive_a_shrink(tmp_path: Path, sync: str) -> None:
    """Killed in epoch 1 (15 steps an epoch on 4 workers): the resumed fit keeps DASO's schedule of epoch 0."""
    job = ElasticJob(tmp_path, "localhost:2,127.0.0.1:2").run(
        4, 2, 4, "--sync", sync, "--kill-rank", "3", "--kill-step", "22"
    )
    assert_one_finished_job(job, workers=2)
    assert_epoch_trained_once(job, epoch=1)
    resumed = [event for event in job.events("train_start") if event["step"] > 0]
    assert {event["step"] for event in resumed} == {20}
    if sync == "daso":
        assert {event["daso_epoch"] for event in resumed} == {1}, "DASO's schedule went on from the commit"


def test_a_fabric_loop_goes_on_after_a_worker_and_its_host_leave(tmp_path: Path) -> None:
    """``hvd_plugins.fabric.ElasticLoop``: the same shrink as the Trainer's, in a loop written by hand."""
    job = ElasticJob(tmp_path, "localhost:2,127.0.0.1:2", script="elastic_fabric.py")
    ends = assert_one_finished_job(job.run(4, 2, 4, "--kill-rank", "3", "--kill-step", "7"), workers=2)
    assert {end["resets"] for end in ends} == {1}
    resumed = {event["step"] for event in job.events("train_start") if event["step"] > 0}
    assert resumed == {5}, "the loop resumes at the last commit (every 5 steps)"
    assert_epoch_trained_once(job, epoch=0)
    assert {end["trained"] for end in ends} == {MAX_STEPS}, "plain values are committed and rolled back too"


def assert_weights_close(job: ElasticJob, reference: ElasticJob) -> None:
    """Every worker's final weights within 1e-5 of the largest weight of the reference run's."""
    want = reference.ends()[0]["weights"]
    scale = max(abs(value) for value in want)
    for end in job.ends():
        worst = max(abs(a - b) for a, b in zip(end["weights"], want, strict=True))
        assert worst <= 1e-5 * scale, f"rank {end['rank']}: {worst:.3g} from the unsharded run (largest {scale:.3g})"


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_a_sharded_fit_loses_a_host_and_goes_on_from_the_copies_it_committed(
    tmp_path: Path, unsharded_shrink: ElasticJob, shard: str
) -> None:
    """The shrink of the unsharded test, sharded: the two survivors hold their own parts and the copies of the
    two that left (kept on the other host), lay the state out over two workers, and end as the unsharded run."""
    job = ElasticJob(tmp_path, "localhost:2,127.0.0.1:2").run(4, 2, 4, "--shard", shard, *SHRINK)
    ends = assert_one_finished_job(job, workers=2)
    assert {event["step"] for event in job.events("train_start") if event["step"] > 0} == {5}
    assert_epoch_trained_once(job, epoch=0)
    assert_weights_close(job, unsharded_shrink)
    assert all(end["commit_held_bytes"] > 0 for end in ends)


def test_zero3_with_a_frozen_layer_loses_a_host_and_goes_on_from_its_commit(tmp_path: Path) -> None:
    """The shrink under ZeRO-3 with the first layer frozen (sharded, held by no optimizer: the commit keeps it
    whole): the survivors end as the same shrink unsharded."""
    frozen = ("--freeze-first", *SHRINK)
    reference = ElasticJob(tmp_path / "none", "localhost:2,127.0.0.1:2", mkdir=True).run(4, 2, 4, *frozen)
    job = ElasticJob(tmp_path / "zero3", "localhost:2,127.0.0.1:2", mkdir=True).run(
        4, 2, 4, "--shard", "parameters", *frozen
    )
    assert_one_finished_job(job, workers=2)
    assert {event["step"] for event in job.events("train_start") if event["step"] > 0} == {5}
    assert_weights_close(job, reference)


def test_a_sharded_fit_takes_in_hosts_that_join_and_rank_zero_lost(tmp_path: Path) -> None:
    """Grow 2 -> 4 (the workers that join hold no part and receive their slices; under ZeRO-3 they built the model
    whole while the survivors' units are placeholders), then, in another job, rank 0 killed on a job of two hosts:
    its survivor (ZeRO-3: its units placeholders, rank 0 now) steps on from its own part and the copy of rank 0's."""
    # slots listed at step 1, the first commit at step 10 (4.5 s of paused steps later): the runs grow there
    grow = ("--grow-step", "1", "--commit-every", "10", "--hosts-after", "localhost:2,127.0.0.1:2")
    grown = {
        shard: ElasticJob(tmp_path / f"grow-{shard}", "localhost:1,127.0.0.1:1", mkdir=True).run(
            2, 2, 4, "--shard", shard, *grow
        )
        for shard in ("gradients", "parameters")
    }
    for job in grown.values():
        assert_one_finished_job(job, workers=4)
    # the same schedule unsharded: the job grows at the first commit after horovodrun noticed the new slots,
    # which a loaded machine may put one commit later; run the reference again until it grew at the same steps
    references: dict[int, ElasticJob] = {}
    for attempt in range(4):
        reference = ElasticJob(tmp_path / f"ref{attempt}", "localhost:1,127.0.0.1:1", mkdir=True).run(2, 2, 4, *grow)
        references.setdefault(grown_at(reference), reference)
        if all(grown_at(job) in references for job in grown.values()):
            break
    for shard, job in grown.items():
        step = grown_at(job)
        assert step in references, f"the {shard} run grew at step {step}, the unsharded ones at {sorted(references)}"
        assert_weights_close(job, references[step])
    lost_rank_zero = ElasticJob(tmp_path / "rank0", "localhost:1,127.0.0.1:1", mkdir=True).run(
        2, 1, 2, "--shard", "parameters", "--kill-rank", "0", "--kill-step", "12"
    )
    (end,) = assert_one_finished_job(lost_rank_zero, workers=1)
    assert end["pid"] != lost_rank_zero.events("killed")[0]["pid"]


def test_a_sharded_fit_that_loses_both_copies_of_a_part_ends_saying_so(tmp_path: Path) -> None:
    """3 hosts of one worker; rank 0 and rank 1, which keeps rank 0's copy, die together: the survivor holds
    neither copy of rank 0's slice, and the job ends with that said, instead of training on with a hole."""
    third = local_host_name()
    job = ElasticJob(tmp_path, f"localhost:1,127.0.0.1:1,{third}:1").run(
        3, 1, 3, "--shard", "gradients", "--kill-ranks", "0,1", "--kill-step", "7", fails=True
    )
    assert job.result is not None
    assert "LostShardsError" in job.result.output and "slices of worker(s) [0] of 3" in job.result.output
    assert not job.events("end"), "no worker finished the fit"
    assert max(event["step"] for event in job.events("batch")) <= 7, "nobody trained on after the loss"


def grown_at(job: ElasticJob) -> int:
    """The step the job resumed at with four workers."""
    return min(event["step"] for event in job.events("train_start") if event["size"] == 4)


def local_host_name() -> str:
    """A third name for this machine that horovodrun starts workers on without ssh: its host name."""
    import socket

    name = socket.gethostname()
    try:
        local = socket.gethostbyname(name).startswith("127.")
    except OSError:
        local = False
    if name in ("localhost", "127.0.0.1") or not local:
        pytest.skip(f"this machine's host name {name!r} does not resolve to a loopback address: no third local host")
    return name


@pytest.mark.parametrize("shard", ["gradients"])
def test_sharded_inside_the_node_survives_a_shrink(tmp_path: Path, shard: str) -> None:
    """sync='hierarchical' with sharding on 2x2: each node holds the state, split over its two workers. A host
    leaves; the survivors on the other node hold every part, and go on sharded over their node."""
    job = ElasticJob(tmp_path, "localhost:2,127.0.0.1:2").run(
        4, 2, 4, "--sync", "hierarchical", "--shard", shard, "--kill-rank", "3", "--kill-step", "22"
    )
    assert_one_finished_job(job, workers=2)
    assert_epoch_trained_once(job, epoch=1)
    assert {event["step"] for event in job.events("train_start") if event["step"] > 0} == {20}
