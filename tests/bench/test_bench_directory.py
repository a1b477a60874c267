"""`kvstreamd bench directory` with three daemon processes on a real redis-server, a short lease
and a short outage: the report it writes, and its figures within the floors."""
from __future__ import annotations

import json

import pytest

from kvstreamd.bench import directory
from tests.fixtures import system_fixture

LEASE_S = 2.0


@pytest.fixture(scope="module")
@system_fixture
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "directory.json"
    run = directory.run(daemons=3, puts=3, lease_s=LEASE_S, outage_s=2.0, json_path=str(path), log=lambda *a: None)
    assert json.loads(path.read_text()) == json.loads(json.dumps(run)), "the JSON written is the report returned"
    return run


def test_the_report_has_each_figure_for_every_node_and_put(report):
    assert report["found"]["samples"] == 3 * 2  # three puts, each looked up by the two other nodes
    assert len(report["found"]["seconds"]) == 6 and report["back"]["samples"] == 1  # the one live node besides
    assert set(report["connections_before"]) == set(report["connections_after"]) == {"n00", "n01", "n02"}
    assert report["fetch"] == {"fetcher": "n01", "holder": "n00", "sources": ["n00"]}
    assert {"seconds", "last_listed_sent_s"} <= report["gone"].keys()
    assert set(report["floors"]) == {"found", "gone", "back", "no_connection_before_a_fetch",
                                     "only_fetcher_and_holder_connected", "one_evalsha_per_lookup"}
    assert "found (put's reply" in directory.table(report)


def test_every_figure_is_within_its_floor(report):
    assert report["found"]["max_s"] <= directory.FOUND_FLOOR_S and report["found"]["missed"] == 0
    assert report["gone"]["seconds"] is not None and (report["gone"]["last_listed_sent_s"] or 0.0) <= LEASE_S
    assert report["back"]["max_s"] <= directory.BACK_FLOOR_S
    assert report["back"]["all_keys_in_redis_s"] <= directory.BACK_FLOOR_S
    assert report["connections_before"] == {"n00": [], "n01": [], "n02": []}
    assert report["connections_after"] == {"n00": ["n01"], "n01": ["n00"], "n02": []}
    assert report["evalsha_per_lookup"] == 1.0
    assert all(report["floors"].values()), report["floors"]


def test_fewer_than_three_daemons_or_more_puts_than_daemons_is_refused():
    with pytest.raises(ValueError, match="--daemons 2: at least 3"):
        directory.run(daemons=2)
    with pytest.raises(ValueError, match=r"--puts 5: between 1 and --daemons \(4\)"):
        directory.run(daemons=4, puts=5)
