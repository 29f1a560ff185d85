"""The in-flight protocol: ``progress()`` never waits, ``wait(meanwhile)`` does, ``Then`` finishes a result once,
and ``finish_all`` waits in order while the later operations move on."""

from __future__ import annotations

from hvd_plugins.core.comm.in_flight import InFlight, Meanwhile, Then, finish_all


class Rounds(InFlight[str]):
    """An operation of ``rounds`` rounds, written to ``log``; a round arrives when the test says so (``arrive``)
    or when the operation waits for it. Its first round starts with it."""

    def __init__(self, name: str, rounds: int, log: list[str]) -> None:
        self.name, self.rounds, self.log = name, rounds, log
        self.started, self.arrived = 1, 0
        log.append(f"{name} starts round 1")

    def arrive(self) -> None:
        self.arrived = self.started

    def progress(self) -> None:
        if self.arrived == self.started < self.rounds:
            self.started += 1
            self.log.append(f"{self.name} starts round {self.started}")

    def ready(self) -> bool:
        self.progress()
        return self.arrived == self.rounds

    def wait(self, meanwhile: Meanwhile = None) -> str:
        while self.arrived < self.rounds:
            self.progress()
            if self.arrived < self.started:
                if meanwhile is not None:
                    meanwhile()
                self.log.append(f"{self.name} waits for round {self.started}")
                self.arrive()
        return f"{self.name} done"


def test_progress_moves_an_operation_on_without_waiting_and_ready_says_whether_wait_would_block() -> None:
    log: list[str] = []
    operation = Rounds("a", rounds=2, log=log)
    operation.progress()
    assert log == ["a starts round 1"]  # the first round has not arrived: nothing to start, nothing waited for
    operation.arrive()
    assert not operation.ready()  # moved on to its second round, which is in flight
    assert log == ["a starts round 1", "a starts round 2"]
    operation.arrive()
    assert operation.ready() and operation.wait() == "a done"
    assert not [line for line in log if "waits" in line]


def test_then_passes_the_result_through_its_finish_once_when_awaited() -> None:
    log: list[str] = []
    finished: list[str] = []
    operation = Rounds("a", rounds=2, log=log)

    def finish(result: str) -> int:
        finished.append(result)
        return len(result)

    then = Then(operation, finish)
    operation.arrive()
    assert not then.ready()  # delegated: the operation moved on to round 2
    then.progress()
    assert finished == []  # neither progress nor ready finishes
    moved: list[str] = []
    assert then.wait(lambda: moved.append("meanwhile")) == len("a done")
    assert finished == ["a done"] and moved == ["meanwhile"]  # the meanwhile reached the operation's wait


def test_finish_all_waits_in_order_and_moves_the_later_operations_on_meanwhile() -> None:
    log: list[str] = []
    first, second, third = (Rounds(name, rounds=2, log=log) for name in ("a", "b", "c"))
    second.arrive()  # b's first round is there before anyone waits
    assert finish_all([first, second, third]) == ["a done", "b done", "c done"]
    assert log.index("b starts round 2") < log.index("a waits for round 1")  # moved on while a waited
    assert log.index("b waits for round 2") > log.index("a waits for round 2")  # awaited only after a
    assert log[-1] == "c waits for round 2"
    assert finish_all([]) == []


def test_the_last_operation_waits_with_nothing_to_move_on() -> None:
    calls: list[Meanwhile] = []

    class Recording(InFlight[int]):
        def progress(self) -> None:
            pass

        def ready(self) -> bool:
            return True

        def wait(self, meanwhile: Meanwhile = None) -> int:
            calls.append(meanwhile)
            return len(calls)

    assert finish_all([Recording(), Recording()]) == [1, 2]
    assert calls[0] is not None and calls[1] is None
