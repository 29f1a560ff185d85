"""The registry the worker jobs report their checks by (tests/workers/_common.py), and the shared jobs built with it.

The shared jobs are composed when their modules are imported, so two checks of one job with one name
fail here, in seconds, rather than at the end of a job.
"""

from __future__ import annotations

import pytest
from _common import Checks, case_argument, key, report_of, reports_of


def first() -> int:
    return 1


def second() -> int:
    return 2


def test_a_check_is_reported_under_its_functions_name_and_read_back_by_the_function() -> None:
    checks = Checks()
    checks.register(first)
    checks.register(time_limit=5.0)(second)
    report = checks.run()
    assert list(report) == ["first", "second"] == [key(first), key(second)]
    assert report_of(report, second) == 2
    assert reports_of({1: report, 0: {"first": {"ok": True, "value": 0}}}, first) == [0, 1]  # in rank order
    with pytest.raises(AssertionError, match="the job reported no check 'second'"):
        report_of({}, second)


def test_a_failing_check_is_recorded_and_the_rest_still_run() -> None:
    checks = Checks()

    @checks.register
    def fails() -> None:
        raise RuntimeError("on purpose")

    checks.register(first)
    report = checks.run()
    assert report["fails"]["ok"] is False and report["fails"]["error"] == "RuntimeError: on purpose"
    assert report_of(report, first) == 1
    with pytest.raises(AssertionError, match="check 'fails' failed: RuntimeError: on purpose"):
        report_of(report, fails)


def test_checks_need_a_name_of_their_own() -> None:
    with pytest.raises(ValueError, match="define the check as a named function"):
        Checks().register(lambda: 1)
    checks = Checks()
    checks.register(first)

    def first_again() -> int:
        return 1

    first_again.__name__ = "first"
    with pytest.raises(ValueError, match="two checks are named 'first'"):
        Checks(checks).register(first_again)


def test_a_case_selects_checks_in_the_jobs_order_and_names_unknown_ones() -> None:
    job = Checks()
    job.register(first)
    job.register(second, time_limit=3.0)
    flag, case = case_argument(second, first)
    assert (flag, case) == ("--case", "second,first")
    assert list(job.selected(case)) == [first, second]
    assert job.selected("") is job
    with pytest.raises(ValueError, match=r"--case names no check of this job: \['third'\]"):
        job.selected("first,third")


def test_the_shared_jobs_compose_without_two_checks_of_one_name() -> None:
    import adasum_checks
    import daso_checks
    import faults_checks
    import hierarchical_checks
    import strategy_batchnorm
    import strategy_features

    two_workers = strategy_features.job(adasum=True)
    assert len(two_workers) == len(strategy_features.JOB) + len(adasum_checks.checks) + 1
    assert list(two_workers)[-1] is strategy_batchnorm.check_uneven_sync_batchnorm  # bounded, so last
    assert list(strategy_features.JOB)[-len(faults_checks.checks) :] == list(faults_checks.checks)
    two_nodes = Checks(hierarchical_checks.JOB, adasum_checks.checks)
    assert len(two_nodes) == len(hierarchical_checks.checks) + len(daso_checks.two_by_two) + len(adasum_checks.checks)
    order = [key(check) for check in hierarchical_checks.checks]
    assert order.index("check_strategy_modes") < order.index("check_compress_node_local")  # compared with its runs
    assert order[-1] == "check_still_one_process_set"  # after every strategy of the job trained
