"""Run the Python snippets of README.rst and docs/*.rst in ONE plain python process, each as a fresh script would run.

    python tests/workers/doc_snippets.py SNIPPETS.json --out DIR

SNIPPETS.json is a list of ``{"name": str, "source": str, "continues": bool}`` written by
tests/test_docs.py, in page order. The process works in DIR (Lightning's logs, timeline files).
Before a snippet that does not continue the one before it, Horovod is shut down and the environment
restored, so every snippet starts as a new script would: some set Horovod variables that only count
before ``hvd.init()``. Writes ``DIR/rank0.json``: one entry per snippet, ``ok`` and the global step
after each ``Trainer.fit`` it called, or the error with its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import lightning.pytorch as pl

FIT_STEPS: list[int] = []  # trainer.global_step after each Trainer.fit


def record_fits() -> None:
    fit = pl.Trainer.fit

    def recording_fit(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        fit(self, *args, **kwargs)
        FIT_STEPS.append(self.global_step)

    pl.Trainer.fit = recording_fit  # type: ignore[method-assign]


def fresh_start(environment: dict[str, str]) -> None:
    if hvd.is_initialized():
        hvd.shutdown()
    os.environ.clear()
    os.environ.update(environment)


def run(source: str, name: str, namespace: dict[str, Any]) -> dict[str, Any]:
    FIT_STEPS.clear()
    try:
        exec(compile(source, f"<python snippet {name}>", "exec"), namespace)
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
    return {"ok": True, "fit_steps": list(FIT_STEPS)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("snippets", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    snippets = json.loads(args.snippets.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    os.chdir(args.out)
    # Snippets restart Horovod in this one process; with an MPI build that needs the Gloo controller,
    # since MPI cannot start again once it finalized (a launcher-less script starts alone either way).
    os.environ.setdefault("HOROVOD_CONTROLLER", "gloo")
    os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "gloo")
    environment = dict(os.environ)
    record_fits()
    report: dict[str, Any] = {}
    namespace: dict[str, Any] = {}
    for snippet in snippets:
        if not snippet["continues"]:
            fresh_start(environment)
            namespace = {"__name__": "__main__"}
        report[snippet["name"]] = run(snippet["source"], snippet["name"], namespace)
        (args.out / "rank0.json").write_text(json.dumps(report))  # after each, in case one hangs


if __name__ == "__main__":
    main()
