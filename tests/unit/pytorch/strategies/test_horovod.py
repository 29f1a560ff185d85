"""The Trainer's HorovodStrategy at construction: bad arguments are refused by name."""

from __future__ import annotations

import pytest

from hvd_plugins import HorovodStrategy
from hvd_plugins.core.sync.daso.config import DasoConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compression": "int8"}, r"compression='int8' is not supported; choose one of \['bf16', 'fp16', 'none'\]"),
        ({"op": "mean"}, r"op='mean' is not supported; choose one of \['average', 'sum', 'adasum'\]"),
        ({"sync": "ring"}, r"sync='ring' is not supported; choose one of \['allreduce', 'hierarchical', 'daso'\]"),
        ({"gradient_predivide_factor": 0}, r"gradient_predivide_factor=0 must be a positive number"),
        ({"gradient_predivide_factor": 2.0, "op": "sum"}, r"works only with op='average', not op='sum'"),
        ({"op": "adasum", "sync": "daso"}, r"op='adasum' works only with sync='allreduce'"),
        ({"op": "sum", "sync": "daso"}, r"op='sum' does not work with sync='daso'.*use op='average'"),
        ({"daso": {"warmup_epochs": 1}}, r"DASO settings need sync='daso'"),
        ({"hierarchical_impl": "nccl"}, r"hierarchical_impl='nccl' is not supported"),
        ({"bucket_mb": -1}, r"bucket_mb=-1 must be a positive number"),
        ({"sync": "hierarchical", "flat_below_mb": -1}, r"flat_below_mb=-1 must be 'auto' or a number of"),
        ({"flat_below_mb": 4.0}, r"flat_below_mb=4.0 works only with sync='hierarchical', not sync='allreduce'"),
        ({"cpu_threads": 0}, r"cpu_threads=0 must be 'auto', None or a whole number of threads >= 1"),
        ({"cpu_threads": "all"}, r"cpu_threads='all' must be 'auto', None or a whole number"),
    ],
)
def test_strategy_rejects_bad_arguments_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HorovodStrategy(**kwargs)


def test_adasum_is_refused_at_construction_by_a_build_without_mpi() -> None:
    import horovod.torch as hvd

    if hvd.mpi_built():
        assert HorovodStrategy(op="adasum").config.op == "adasum"  # the controller is checked when the job starts
    else:
        with pytest.raises(ValueError, match=r"op='adasum' needs Horovod's MPI controller, but this Horovod build"):
            HorovodStrategy(op="adasum")


def test_daso_settings_accept_dicts_and_name_unknown_keys() -> None:
    strategy = HorovodStrategy(sync="daso", daso={"warmup_epochs": 1, "max_global_skips": 4})
    assert strategy.config.daso == DasoConfig(warmup_epochs=1, max_global_skips=4)
    with pytest.raises(ValueError, match=r"unknown DASO setting\(s\) \['warmup'\]"):
        HorovodStrategy(sync="daso", daso={"warmup": 1})
