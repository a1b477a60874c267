"""Every key the schema marks reloadable changes what a running daemon does once SIGHUP's reload
has read it: each part takes it in its reconfigure(cfg). One row per key: the value it is
changed to and what the daemon's parts then do differently; a reloadable key without a row
fails, so a key cannot be marked reloadable and left unapplied."""
from __future__ import annotations

import dataclasses
import logging
import tomllib

from kvstreamd import config as config_mod
from kvstreamd.requests import FetchRequest
from kvstreamd.lab.daemons import _toml

MiB = 2**20
REQUEST = FetchRequest("synthetic-test-model", list(range(600)))


def options(d):
    """What a fetch arriving now would run by."""
    return d.node.fetches.options(REQUEST)


def prefetch(d):
    return d.node.features["prefetch"]


# (section, key) -> (the keys to write, what the daemon does once it has them)
CHANGES = {
    ("node", "log_level"): ({"node": {"log_level": "debug"}},
                            lambda d: logging.getLogger().level == logging.DEBUG),
    ("api", "max_fetches"): ({"api": {"max_fetches": 3}}, lambda d: d.node.fetches.max_fetches == 3),
    ("api", "buffer_lease_s"): ({"api": {"buffer_lease_s": 7.5}}, lambda d: d.node.leases.lease_s == 7.5),
    ("api", "spare_buffer_bytes"): ({"api": {"spare_buffer_bytes": "3MiB"}},
                                    lambda d: d.node.leases.spares.budget == 3 * 2**20),
    ("peer", "peers"): ({"peer": {"peers": ["127.0.0.1:9"]}},
                        lambda d: {p["address"] for p in d.peers.info() if p["configured"]} == {"127.0.0.1:9"}),
    ("peer", "secret"): ({"peer": {"secret": "a-new-cluster-secret"}},
                         lambda d: d.peers.secret == b"a-new-cluster-secret"),
    ("peer", "secret_file"): ({"peer": {"secret": "", "secret_file": "{tmp}/secret"}},
                              lambda d: d.peers.secret == b"the-secret-in-a-file"),
    ("peer", "retry_min_s"): ({"peer": {"retry_min_s": 0.35}}, lambda d: d.peers.cfg.retry_min_s == 0.35),
    ("peer", "retry_max_s"): ({"peer": {"retry_max_s": 4.5}}, lambda d: d.peers.cfg.retry_max_s == 4.5),
    ("store", "memory_budget"): ({"store": {"memory_budget": "300MiB"}},
                                 lambda d: d.store.usage().memory_budget == 300 * MiB),
    ("store", "disk_budget"): ({"store": {"disk_budget": "500MiB"}},
                               lambda d: d.store.usage().disk_budget == 500 * MiB),
    ("store", "pin_budget"): ({"store": {"pin_budget": "20MiB"}}, lambda d: d.store.usage().pin_budget == 20 * MiB),
    ("store", "keep_fetched"): ({"store": {"keep_fetched": False}}, lambda d: options(d).keep_fetched is False),
    ("prefetch", "enabled"): ({"prefetch": {"enabled": True}}, lambda d: prefetch(d).status()["enabled"] is True),
    ("prefetch", "max_successors"): ({"prefetch": {"max_successors": 5}},
                                     lambda d: prefetch(d).cfg.prefetch.max_successors == 5),
    ("prefetch", "min_count"): ({"prefetch": {"min_count": 4}}, lambda d: prefetch(d).cfg.prefetch.min_count == 4),
    ("prefetch", "window_s"): ({"prefetch": {"window_s": 60.0}}, lambda d: prefetch(d).cfg.prefetch.window_s == 60),
    ("prefetch", "memory_share"): ({"prefetch": {"memory_share": 0.5}},
                                   lambda d: prefetch(d).status()["share_bytes"] == d.store.usage().memory_budget // 2),
    ("prefetch", "deadline_ms"): ({"prefetch": {"deadline_ms": 4321}},
                                  lambda d: prefetch(d).cfg.prefetch.deadline_ms == 4321),
    ("codec", "levels"): ({"codec": {"levels": ["fast"]}},
                          lambda d: options(d).levels == ("fast",) and d.node.puts.levels == ("fast",)),
    ("fetch", "deadline_ms"): ({"fetch": {"deadline_ms": 1234}}, lambda d: options(d).deadline_ms == 1234),
    ("fetch", "recompute_tokens_per_s"): ({"fetch": {"recompute_tokens_per_s": 99.0}},
                                          lambda d: options(d).recompute_tokens_per_s == 99.0
                                          and d.peers.serving.recompute_tokens_per_s == 99.0),
    ("fetch", "stall_s"): ({"fetch": {"stall_s": 0.7}}, lambda d: options(d).stall_s == 0.7),
    ("directory", "idle_s"): ({"directory": {"idle_s": 12.0}}, lambda d: d.peers.idle_s == 12.0),
    ("policy", "experiment"): ({"policy": {"experiment": {"fraction": 1.0, "rule": "cachegen", "levels": ["fast"]}}},
                               lambda d: options(d).arm == "candidate" and options(d).rule == "cachegen"
                               and d.node.ab()["experiment"]["fraction"] == 1.0),
}


def reloadable_keys() -> set[tuple[str, str]]:
    return {(name, f.name) for name, cls in config_mod._SECTIONS.items() for f in dataclasses.fields(cls)
            if f.metadata["reload"]}


def test_every_reloadable_key_has_a_row():
    assert set(CHANGES) == reloadable_keys()


def _rewrite(path, changes: dict[str, dict], tmp) -> None:
    with open(path, "rb") as f:
        sections = tomllib.load(f)
    for sec, kv in changes.items():
        sections.setdefault(sec, {}).update({k: v.format(tmp=tmp) if isinstance(v, str) else v for k, v in kv.items()})
    path.write_text("".join(f"[{sec}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in kv.items())
                            for sec, kv in sections.items()))


async def test_each_reloadable_key_changes_what_the_daemon_does_after_a_reload(inprocess, tmp_path):
    (tmp_path / "secret").write_text("the-secret-in-a-file\n")
    (tmp_path / "secret").chmod(0o600)
    [d] = await inprocess(["a"])
    level = logging.getLogger().level
    unapplied, unchanged = [], []
    try:
        for (sec, key), (changes, does) in CHANGES.items():
            if does(d):
                unchanged.append(f"[{sec}] {key}")  # the test would prove nothing: it does so already
                continue
            _rewrite(d.cfg.source, changes, tmp_path)
            await d.reload()
            if not does(d):
                unapplied.append(f"[{sec}] {key}")
    finally:
        logging.getLogger().setLevel(level)
    assert not unchanged, f"already so before the reload: {unchanged}"
    assert not unapplied, f"reloaded but not applied: {unapplied}"
