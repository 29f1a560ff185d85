"""The benchmark scripts run end to end in their smoke sizes and print sane numbers.

These check that each benchmark works and that what it prints is self-consistent (positive rates,
byte counts equal to the analytic expectation, tables and dated reports present), never how fast
anything is. Drivers run in this process as ``benchmarks.<name>.main(argv)`` (what ``python -m
benchmarks.<name>`` runs), which spares each one the seconds of importing torch and Lightning
again; their workers are real jobs started as ``python benchmarks/<name>.py``, so both command
forms stay working.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `benchmarks` is a package of the checkout, not of the installed project

from benchmarks import (  # noqa: E402
    background_progress,
    comm_volume,
    compiled,
    consolidate,
    duplex,
    elastic,
    emulated_cluster,
    gloo_allreduce,
    overhead,
    precisions,
    sharding,
    small_collectives,
    sparse_gradients,
    transport,
    versus_torch,
    wire_dtypes,
)
from hvd_plugins.core.backend.bfloat16 import horovod_takes_bfloat16  # noqa: E402
from hvd_plugins.testing.netns_cluster import SKIP_EXIT_CODE, process_tag  # noqa: E402

# The package modules this file's jobs exercise (tests/unit/test_module_coverage.py reads it).
COVERS = (
    "hvd_plugins.core.tables",
    "hvd_plugins.testing.benchmarking",
    "hvd_plugins.testing.netns_cluster",
    "hvd_plugins.testing.reports",
)

pytestmark = pytest.mark.multiprocess


def run_main(module: ModuleType, argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """A script's ``main(argv)`` in this process: its exit code and what it printed."""
    try:
        code = module.main(list(argv))
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    printed = capsys.readouterr()
    return code, printed.out + printed.err


def skip_without_namespaces(code: int, printed: str) -> None:
    """The emulated-cluster scripts return SKIP_EXIT_CODE where namespaces cannot be made."""
    if code == SKIP_EXIT_CODE:
        pytest.skip(printed.strip().splitlines()[-1])


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
    return {line.split()[0] for line in listed if line.strip()}


def assert_no_namespaces_left(before: set[str]) -> None:
    """The driver removed what it made: no namespace of this process's clusters (prefix ``hb<pid>``) is new.

    Namespaces that existed before (the suite's MPI nodes, other jobs' clusters) are not the driver's.
    """
    leftovers = sorted(name for name in namespaces() - before if name.startswith(process_tag()))
    assert not leftovers, f"namespaces left behind: {leftovers}"


def assert_dated_report(path: Path, script: str, argv: Sequence[str], verb: str = "measured") -> str:
    """The report opens with the date, the machine and the command; returns what follows the header."""
    text = path.read_text()
    first, second, blank, body = text.split("\n", 3)
    assert re.fullmatch(rf"{verb}: \d{{4}}-\d\d-\d\d on \d+ cores \(.*\), Python [\d.]+, torch .+, Horovod .+", first)
    assert second == "command: " + " ".join(["python", f"benchmarks/{script}", *argv]) and blank == "", text[:500]
    return body


# ------------------------------------------------------------------------------------------ sharding
def test_sharding_smoke_reports_a_quarter_less_state_and_every_setting_timed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--smoke", "--report", str(tmp_path / "sharding.txt")]
    code, printed = run_main(sharding, argv, capsys)
    assert code == 0, printed[-3000:]
    state = {m[0]: float(m[1]) for m in re.findall(r"memory (\w+)\s+N=2\s+state\s+([0-9.]+) MiB", printed)}
    assert set(state) == {"none", "optimizer", "gradients", "parameters"}, printed
    assert all(state[shard] < 0.6 * state["none"] for shard in ("optimizer", "gradients", "parameters")), state  # ~1/2
    times = re.findall(r"steps 2x1 (\w+)\s+([0-9.]+) ms", printed)
    assert sorted(shard for shard, _ in times) == ["gradients", "none", "optimizer", "parameters"] and all(
        float(t) > 0 for _, t in times
    )
    held = {m[0]: float(m[1]) for m in re.findall(r"^\s*(\w+)\s+2\s+([0-9.]+)\s", printed, re.MULTILINE)}
    assert held["parameters"] < 0.7 * held["none"], held  # half of the units'; the tied embedding stays whole
    body = assert_dated_report(tmp_path / "sharding.txt", "sharding.py", argv)
    assert body.startswith("Sharding: Transformer LM") and "state / (unsharded/N)" in body


# ------------------------------------------------------------------------------------------ overhead
def test_compiled_smoke_times_eager_and_both_compiled_forms_in_every_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run_main(compiled, ["--smoke", "--report", str(tmp_path / "compiled.txt")], capsys)
    assert code == 0, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["transformer"] and len(line.split()) == 7]
    assert [(row[1], row[2]) for row in rows] == [(s, v) for s in compiled.SETTINGS for v in compiled.VARIANTS]
    for row in rows:
        assert float(row[3]) > 0 and row[5].endswith("x") and float(row[6]) >= 0, row
    assert (tmp_path / "compiled.txt").exists()


def test_overhead_smoke_prints_positive_rates_and_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--smoke", "--report", str(tmp_path / "overhead.txt")]
    code, printed = run_main(overhead, argv, capsys)
    assert code == 0, printed[-3000:]
    rates = dict(re.findall(r"(horovod_loop|horovod_strategy|lightning_ddp)=([0-9.]+)", printed))
    assert set(rates) == {"horovod_loop", "horovod_strategy", "lightning_ddp"}, printed
    assert all(float(rate) > 0 for rate in rates.values()), rates
    ratio_lines = [line for line in printed.splitlines() if line.lstrip().startswith(("b/a", "b/c"))]
    assert len(ratio_lines) == 2, printed
    for line in ratio_lines:
        measured = re.search(r"\s([0-9.]+)\s+>=", line)
        assert measured is not None and float(measured.group(1)) > 0, line
        assert line.rstrip().endswith(("met", "not met")), line
    body = assert_dated_report(tmp_path / "overhead.txt", "overhead.py", argv)
    assert body.startswith("overhead: 2 workers on CPU") and "median rates:" in body


# ------------------------------------------------------------------------------------------ gloo_allreduce
def test_sparse_gradients_smoke_times_both_ways_of_sending_an_embedding_gradient(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--smoke", "--report", str(tmp_path / "sparse_gradients.txt")]
    code, printed = run_main(sparse_gradients, argv, capsys)
    assert code == 0, printed[-3000:]
    rows = [line.split() for line in printed.splitlines() if "rows (" in line]
    assert len(rows) == 4, printed  # two cases x two ways
    for cells in rows:
        mebibytes, median_ms, ratio = float(cells[-4]), float(cells[-3]), float(cells[-1])
        assert mebibytes >= 0 and median_ms > 0 and ratio > 0, cells  # the smoke size sends under 0.01 MiB
        if "sparse_as_dense=True" not in cells:
            assert ratio == 1.0, cells
    assert_dated_report(tmp_path / "sparse_gradients.txt", "sparse_gradients.py", argv)


def test_gloo_allreduce_smoke_times_both_libraries_on_checked_sums(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--smoke", "--report", str(tmp_path / "gloo_allreduce.txt")]
    code, printed = run_main(gloo_allreduce, argv, capsys)
    assert code == 0, printed[-3000:]  # a sum that differs from the expected one fails the job
    rows = [line.split() for line in printed.splitlines() if line.lstrip().startswith(("one tensor", "model's"))]
    assert len(rows) == 6, printed  # two cases x three jobs
    for cells in rows:
        median_ms, ratio = float(cells[-3]), float(cells[-1])
        assert median_ms > 0 and ratio > 0, cells
        if cells[-4] == "torch":
            assert ratio == 1.0, cells
    assert "as its 4 tensors" in printed, printed  # SMOKE_WIDTHS: two layers, a weight and a bias each
    body = assert_dated_report(tmp_path / "gloo_allreduce.txt", "gloo_allreduce.py", argv)
    assert body.startswith("gloo_allreduce: 2 workers on CPU")


def test_sharding_hybrid_smoke_compares_sharded_inside_the_node_with_the_two_level_allreduce(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--smoke", "--hybrid", "--report", str(tmp_path / "hybrid.txt")]
    code, printed = run_main(sharding, argv, capsys)
    assert code == 0, printed
    for shard in ("none", "optimizer", "gradients"):
        assert f"hybrid {shard}" in printed, printed
    body = assert_dated_report(tmp_path / "hybrid.txt", "sharding.py", argv)
    assert body.startswith("Sharded inside the node:")


# ------------------------------------------------------------------------------------------ small_collectives
def test_small_collectives_smoke_times_each_operation_with_the_timeline_off_and_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--smoke", "--report", str(tmp_path / "small.txt")]
    code, printed = run_main(small_collectives, argv, capsys)
    assert code == 0, printed
    for timeline in ("off", "DYNAMIC", "file"):
        line = next(line for line in printed.splitlines() if f"timeline {timeline} " in line)
        times = [float(word) for word, unit in zip(line.split(), line.split()[1:], strict=False) if unit == "ms"]
        assert len(times) == 3 and all(0 < t < 1000 for t in times), line
    body = assert_dated_report(tmp_path / "small.txt", "small_collectives.py", argv)
    assert body.startswith("small_collectives: N workers on this machine")


# ------------------------------------------------------------------------------------------ wire_dtypes
@pytest.mark.skipif(not horovod_takes_bfloat16(), reason="this Horovod takes no bfloat16; run hvd-build-horovod")
def test_wire_dtypes_smoke_halves_the_bytes_and_loses_no_bfloat16_element(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--smoke", "--report", str(tmp_path / "wire.txt")]
    code, printed = run_main(wire_dtypes, argv, capsys)
    assert code == 0, printed
    body = assert_dated_report(tmp_path / "wire.txt", "wire_dtypes.py", argv)
    rows = {line.split()[2]: line.split() for line in body.splitlines() if line.strip().startswith("gloo")}
    assert set(rows) == {"fp32", "fp16", "bf16"}, body
    assert rows["bf16"][-1] == "0" and rows["fp32"][-1] == "0" and rows["fp16"][-1] != "0", body  # fp16 loses some


# ------------------------------------------------------------------------------------------ precisions
@pytest.mark.skipif(not horovod_takes_bfloat16(), reason="this Horovod takes no bfloat16; run hvd-build-horovod")
def test_precisions_smoke_trains_digits_in_each_precision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--smoke", "--report", str(tmp_path / "precisions.txt")]
    code, printed = run_main(precisions, argv, capsys)
    assert code == 0, printed
    body = assert_dated_report(tmp_path / "precisions.txt", "precisions.py", argv)
    lines = [line.strip() for line in body.splitlines() if re.search(r"\s(b?float\d+)\s", line)]
    rows = {re.split(r"\s{2,}", line)[0]: line for line in lines}
    assert "bfloat16" in rows["bf16-true"] and "float32" in rows["32-true"], body
    kib = {label: float(line.split()[-1]) for label, line in rows.items()}
    assert abs(kib["bf16-true"] * 2 - kib["32-true"]) < 0.2 and kib["bf16-mixed, bf16 wire"] == kib["bf16-true"], body


# ------------------------------------------------------------------------------------------ consolidate
def test_consolidate_smoke_the_tool_holds_no_copy_of_the_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, printed = run_main(consolidate, ["--smoke", "--report", str(tmp_path / "consolidate.txt")], capsys)
    assert code == 0, printed
    tool = printed.split("python -m hvd_plugins.consolidate", 1)[1].split()
    assert float(tool[2].rstrip("x")) < consolidate.AIM, printed  # its own memory: no copy of the state


# ------------------------------------------------------------------------------------------ elastic
def test_elastic_smoke_times_commits_and_a_recovery_from_a_killed_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sharded (ZeRO-2): the unsharded path is what tests/test_elastic.py runs most; this adds the parts kept."""
    argv = ["--smoke", "--shard", "gradients", "--report", str(tmp_path / "elastic.txt")]
    code, printed = run_main(elastic, argv, capsys)
    assert code == 0, printed
    recovery = printed.split("recovery: death to next completed step", 1)[1].split()
    assert 0 < float(recovery[0]) < 60, printed
    redone = int(printed.split("steps redone", 1)[1].split()[0])
    assert 0 < redone <= 5, printed  # killed in the middle of the second interval of 5 steps
    assert float(printed.split("commit cost, every 5 steps", 1)[1].split()[0]) > 0
    assert 0 < float(printed.split("join: listed to the first step of 4 workers", 1)[1].split()[0]) < 120
    held = float(printed.split("commit keeps per worker (own part + a copy)", 1)[1].split()[0])
    assert held > 0 and "aim <= 2/N" in printed, printed  # the tiny model's parts are mostly their headers
    body = assert_dated_report(tmp_path / "elastic.txt", "elastic.py", argv)
    assert body.startswith("elastic, shard='gradients': 4 workers on 2 hosts of this machine")


# ------------------------------------------------------------------------------------------ background_progress
def test_background_progress_smoke_times_each_way_of_waiting_on_checked_legs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--smoke", "--report", str(tmp_path / "background_progress.txt")]
    code, printed = run_main(background_progress, argv, capsys)
    assert code == 0, printed[-3000:]  # a shard that arrives wrong fails the job
    rows = {case: printed.split(case, 1)[1].splitlines()[0].split() for case in background_progress.CASES}
    assert all(float(cells[0]) > 0 for cells in rows.values()), rows  # 'done ms' of every case
    assert rows["awaited at once"][2:] == rows["polled, idle"][2:] == ["-", "-"], rows  # ran no pass
    share, percent, first_pass_ms = rows["polled, computing"][2:]
    assert 0 <= float(share) <= 100 and percent == "%" and float(first_pass_ms) > 0, rows
    body = assert_dated_report(tmp_path / "background_progress.txt", "background_progress.py", argv)
    assert body.startswith("background_progress: 2 workers on CPU as 2 nodes of 1")


# ------------------------------------------------------------------------------------------ comm_volume
def test_comm_volume_smoke_counts_equal_the_analytic_expectation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The script checks its counters against its formulas; here a few counts are also worked out by hand."""
    argv = ["--smoke", "--report", str(tmp_path / "comm_volume.txt")]
    code, printed = run_main(comm_volume, argv, capsys)
    assert code == 0, printed[-3000:]
    assert "all measured counts equal the analytic expectation" in printed, printed
    header = re.search(r"cross_size 2\); .* P = ([\d,]+) parameters; (\d+) optimizer steps", printed)
    assert header is not None, printed
    params, steps = int(header.group(1).replace(",", "")), int(header.group(2))
    assert steps == 6, "DASO sends and merges once only from 6 steps on"
    rows = {tuple(line.split()[:2]): line.split() for line in printed.splitlines() if line.split()[:1] in (
        ["allreduce"], ["hierarchical"], ["daso"])}  # fmt: skip
    cross = {key: int(cells[4].replace(",", "")) for key, cells in rows.items()}
    for sync in ("allreduce", "hierarchical", "daso"):
        for compression in ("none", "fp16"):
            assert " ".join(rows[(sync, compression)][-3:]) == "yes (all ranks)", rows
        assert cross[(sync, "none")] > 0 and cross[(sync, "fp16")] * 2 == cross[(sync, "none")], (sync, cross)
    shard = math.ceil(params / 2)  # each of a node's 2 workers carries half the parameters across
    assert cross[("allreduce", "none")] == params * 4 * steps
    assert cross[("hierarchical", "none")] == shard * 4 * steps
    # one cycling send, then the closing average: a node's workers hold the same parameters, so each
    # carries its half across, as a send does (an average over all four would send all of them)
    assert cross[("daso", "none")] == shard * 4 * 2
    body = assert_dated_report(tmp_path / "comm_volume.txt", "comm_volume.py", argv)
    assert body.rstrip().endswith("all measured counts equal the analytic expectation")


# ------------------------------------------------------------------------------------------ emulated_cluster


def test_emulated_cluster_smoke_on_an_unshaped_link_keeps_node_aware_steps_within_the_margin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The benchmark itself holds the margin (--max-step-ratio) and exits 1 past it; this runs it."""
    argv = ["--smoke", "--link-mbit", "unshaped", "--max-step-ratio", "1.5", "--results-dir", str(tmp_path)]
    code, printed = run_main(emulated_cluster, argv, capsys)
    skip_without_namespaces(code, printed)
    assert code == 0, printed[-3000:]
    assert "too slow" not in printed
    modes = {run["mode"] for run in json.loads((tmp_path / "emulated_sweep.json").read_text())["runs"]}
    assert modes == {"allreduce/none", "daso/fp16"}  # 2x1: no node-local legs for the two-level allreduce


def test_emulated_cluster_smoke_runs_flat_and_daso_and_writes_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--smoke", "--results-dir", str(tmp_path)]
    before = namespaces()
    code, printed = run_main(emulated_cluster, argv, capsys)
    skip_without_namespaces(code, printed)
    assert code == 0, printed[-3000:]
    table = {tuple(line.split()[1:4]): line.split() for line in printed.splitlines() if line.startswith("smoke ")}
    expected = {("2x1", "50", "allreduce/none"), ("2x1", "50", "daso/fp16")}
    assert set(table) == expected, printed
    for key, cells in table.items():
        step_ms, cross_kb, accuracy = float(cells[6]), float(cells[7]), float(cells[8])
        assert step_ms > 0 and cross_kb > 0 and 0 <= accuracy <= 100, cells
        assert (cells[9] == "(baseline)") == (key[2] == "allreduce/none"), cells
    records = json.loads((tmp_path / "emulated_sweep.json").read_text())
    assert records["measured"]["command"] == "python benchmarks/emulated_cluster.py " + " ".join(argv)
    assert len(records["runs"]) == len(expected)
    for run in records["runs"]:
        assert run["steps"] >= 2 and run["mean_step_s"] > 0, run
        phases = set(run["phases"])
        if run["mode"].startswith("daso"):  # the smoke run may stop at its target before the cooldown epoch
            assert "warmup" in phases and phases <= {"warmup", "cycling", "cooldown"}, phases
        else:
            assert phases == {"sync"}, phases
        assert run["phases"].get("sync", run["phases"].get("warmup"))["cross_node_bytes_per_step"] > 0, run
    for name in ("emulated_sweep.csv", "emulated_sweep.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert assert_dated_report(tmp_path / "emulated_sweep.txt", "emulated_cluster.py", argv).startswith(
        "emulated_cluster sweep:"
    )
    assert_no_namespaces_left(before)


# ------------------------------------------------------------------------------------------ transport
def test_transport_smoke_runs_the_packages_and_a_process_set_transport_and_checks_the_sums(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, printed = run_main(transport, ["--smoke"], capsys)
    assert code == 0, printed[-3000:]
    rows = {line.split()[1]: line for line in printed.splitlines() if line.split()[:3:2] == ["2x1", "1k"]}
    assert set(rows) == {"static", "alltoall"}, printed
    for name, line in rows.items():
        assert re.search(r"\syes\s+0/1$", line.rstrip()), (name, line)  # two-level sum correct, no failure
        global_ms, two_level_ms = re.findall(r"\s([0-9.]+) \(", line)[0], re.findall(r"\s([0-9.]+) \(", line)[-1]
        assert float(global_ms) > 0 and float(two_level_ms) > 0, line


# ------------------------------------------------------------------------------------------ duplex
def test_duplex_times_every_collective_on_two_emulated_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--link-mbit", "unshaped", "--mb", "0.1", "--trials", "1", "--report", str(tmp_path / "duplex.txt")]
    before = namespaces()
    code, printed = run_main(duplex, argv, capsys)
    skip_without_namespaces(code, printed)
    assert code == 0, printed[-3000:]
    rows = {line.split()[1]: line.split() for line in printed.splitlines() if line.split()[:1] == ["unshaped"]}
    assert set(rows) == {"flat", "exchange", "relay", "one_way", "two_level"}, printed
    for cells in rows.values():
        assert float(cells[2]) > 0 and float(cells[4]) > 0, cells
    body = assert_dated_report(tmp_path / "duplex.txt", "duplex.py", argv)
    assert body.startswith("duplex: 2 nodes x 2 workers, 0.1 MB")
    assert_no_namespaces_left(before)


# ------------------------------------------------------------------------------------------ versus_torch
def test_versus_torch_smoke_runs_torchs_tools_and_ours_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--smoke", "--workers", "2", "--report", str(tmp_path / "versus_torch.txt")]
    code, printed = run_main(versus_torch, argv, capsys)
    assert code == 0, printed[-3000:]
    speeds, costs = printed.split("tiny: where a step goes", 1)
    rows, cost_rows = {}, {}
    for text, table in ((speeds, rows), (costs, cost_rows)):
        for line in text.splitlines():
            cells = line.split()
            if cells[:1] == ["2"] and len(cells) > 1 and cells[1] in versus_torch.ALL:
                table[cells[1]] = cells[4:] if cells[2] == "vs" else cells[2:]
    assert sorted(rows) == sorted(versus_torch.ALL) == sorted(cost_rows), printed
    # Where a step goes: every variant's training thread works; only the workers that talk have time over the floor.
    for variant, (ms, over, cpu_main, _busiest, _rest, copied) in cost_rows.items():
        assert float(ms) > 0 and float(cpu_main) > 0, (variant, cost_rows[variant])
        assert (over == "-") == (variant == versus_torch.NO_COMM), (variant, cost_rows[variant])
        # our gradients are views of their buckets: backward adds into them, nothing is copied in or back
        assert copied == ("0.0" if variant in versus_torch.OUR_VARIANTS else "-"), (variant, cost_rows[variant])
    for variant, (ms, speed, peak, idle, memory, _sent) in rows.items():
        assert float(ms) > 0 and float(peak) >= float(idle) > 0, (variant, rows[variant])
        paired = variant in versus_torch.COUNTERPART
        assert speed.endswith("x") == paired and memory.endswith("x") == paired, (variant, rows[variant])
    # Loopback bytes: the workers that never talk send next to nothing; DDP and the flat sync both ring-allreduce
    # every gradient, 2 (N-1)/N of the model's bytes per step and worker, plus what their launchers exchange.
    parameters = sum(p.numel() for p in versus_torch._model(versus_torch.SMOKE_MODELS[0].sizes).parameters())
    ring_mib = parameters * 4 / 2**20
    assert float(rows["no_comm"][5]) < 0.5 * ring_mib, rows["no_comm"]
    for variant in ("ddp", "flat"):
        assert float(rows[variant][5]) >= 0.9 * ring_mib - 0.005, (variant, rows[variant], ring_mib)  # 2 decimals
    body = assert_dated_report(tmp_path / "versus_torch.txt", "versus_torch.py", argv)
    assert body.startswith("tiny: TransformerLM") and "speed: torch's step time / ours" in body


def test_versus_torch_rounds_reads_horovods_timeline_with_both_loops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--smoke", "--rounds", "--workers", "2", "--report", str(tmp_path / "sync_rounds.txt")]
    code, printed = run_main(versus_torch, argv, capsys)
    assert code == 0, printed[-3000:]
    rows = {}
    for line in printed.splitlines():
        cells = line.rsplit(None, 7)  # the loop's name has spaces
        if line.split()[:2] == ["tiny", "2"] and len(cells) == 8:
            rows[cells[0].split(None, 2)[2]] = [float(cell) for cell in cells[1:]]
    assert sorted(rows) == sorted(versus_torch.LOOPS), printed
    for loop, (step_ms, rounds, allreduces, negotiate, copies, ring, cpu) in rows.items():
        # allreduces per step > 0, not >= 1: Horovod's timeline writer can lose the last step's events at exit
        assert step_ms > 0 and rounds > 0 and allreduces > 0 and ring > 0, (loop, rows[loop])
        assert negotiate >= 0 and copies >= 0 and cpu >= 0, (loop, rows[loop])
    body = assert_dated_report(tmp_path / "sync_rounds.txt", "versus_torch.py", argv)
    assert "rounds of Horovod's loop" in body


# ------------------------------------------------------------------------------------------ ray_launch
def test_ray_launch_smoke_times_the_same_script_under_horovodrun_and_on_ray(tmp_path: Path) -> None:
    """Run as its own process: Ray's cluster starts and stops with it, not inside this test process."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'hvd_plugins[ray]' runs this")
    argv = ["--smoke", "--report", str(tmp_path / "ray_launch.txt")]
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ray_launch.py"), *argv],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = {
        line.split()[0]: line.split()[1:]
        for line in done.stdout.splitlines()
        if line.split()[:1] in (["horovodrun"], ["ray"])
    }
    assert sorted(rows) == ["horovodrun", "ray"], done.stdout
    for launch, (first, fit, step, ratio) in rows.items():
        # under horovodrun the workers run before fit: its fit-to-first-step can print as 0.0
        assert float(first) > 0 and float(first) >= float(fit) >= 0, (launch, rows[launch])
        assert float(step) > 0 and ratio.endswith("x"), (launch, rows[launch])
    assert float(rows["ray"][1]) > 0, rows  # the actors start inside fit
    assert rows["horovodrun"][3] == "1.00x"
    body = assert_dated_report(tmp_path / "ray_launch.txt", "ray_launch.py", argv)
    assert body.startswith("ray_launch: 2 workers on one machine")
