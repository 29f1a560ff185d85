"""What a Ray launch asks of the cluster, checked before any actor starts: the arguments, the resources, the
elastic range."""

from __future__ import annotations

import pytest

from hvd_plugins.core.backend.ray_spec import ElasticRange, RayWorkerSpec, refuse_what_the_cluster_lacks


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"num_workers": 0}, "num_workers=0"),
        ({"num_workers": 2.5}, "num_workers=2.5"),
        ({"num_workers": 2, "num_cpus_per_worker": -1}, "num_cpus_per_worker=-1"),
        ({"num_workers": 2, "placement": "spread"}, "placement='spread'"),
        ({"num_workers": 2, "placement_timeout_s": 0}, "placement_timeout_s=0"),
    ],
)
def test_bad_arguments_name_the_value_and_what_is_allowed(arguments: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        RayWorkerSpec(**arguments)


def test_a_bundle_holds_each_workers_resources_and_the_cluster_must_hold_them_all() -> None:
    spec = RayWorkerSpec(4, num_cpus_per_worker=2, use_gpu=True, resources_per_worker={"fast_disk": 1})
    assert spec.bundle() == {"CPU": 2.0, "GPU": 1.0, "fast_disk": 1.0}
    refuse_what_the_cluster_lacks(spec, {"CPU": 8, "GPU": 4, "fast_disk": 4})
    with pytest.raises(ValueError, match="no GPU"):
        refuse_what_the_cluster_lacks(spec, {"CPU": 8, "fast_disk": 4})
    with pytest.raises(ValueError, match="needs 8 CPU, and the Ray cluster has 6"):
        refuse_what_the_cluster_lacks(spec, {"CPU": 6, "GPU": 4, "fast_disk": 4})


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"resources_per_worker": {"GPU": 1}}, "use_gpu=True"),
        ({"resources_per_worker": {"disk": -1}}, r"resources_per_worker\['disk'\]=-1"),
        ({"num_cpus_per_worker": 0}, "num_cpus_per_worker=0 with no GPU"),
    ],
)
def test_resources_that_ray_cannot_place_are_named(arguments: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        RayWorkerSpec(2, **arguments)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"min_workers": 0}, "min_workers=0"),
        ({"min_workers": True}, "min_workers=True"),
        ({"min_workers": 3, "max_workers": 2}, "max_workers=2: .* at least min_workers=3"),
        ({"timeout_s": 0}, "elastic_timeout_s=0"),
        ({"reset_limit": -1}, "reset_limit=-1"),
    ],
)
def test_an_elastic_range_names_the_bad_bound(arguments: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ElasticRange(**arguments)


def test_an_elastic_job_starts_inside_its_range_fills_nodes_and_waits_for_them() -> None:
    with pytest.raises(ValueError, match="num_workers=8 .* between min_workers=2 and max_workers=4"):
        RayWorkerSpec(8, elastic=ElasticRange(2, 4))
    with pytest.raises(ValueError, match="num_workers=1 .* between min_workers=2 and max_workers=no limit"):
        RayWorkerSpec(1, elastic=ElasticRange(2))
    with pytest.raises(ValueError, match="placement='SPREAD' places a fixed number"):
        RayWorkerSpec(4, placement="SPREAD", elastic=ElasticRange(2, 4))
    elastic = RayWorkerSpec(4, use_gpu=True, elastic=ElasticRange(2, 4))
    refuse_what_the_cluster_lacks(elastic, {"CPU": 1, "GPU": 1})  # it waits for nodes; a fixed job would not
    with pytest.raises(ValueError, match="needs 4 CPU"):
        refuse_what_the_cluster_lacks(RayWorkerSpec(4, use_gpu=True), {"CPU": 1, "GPU": 4})
    with pytest.raises(ValueError, match="no GPU"):  # no node could ever hold one of its workers
        refuse_what_the_cluster_lacks(elastic, {"CPU": 8})
