"""`kvstreamd doctor`: the checklist an operator runs when first tokens get slow, against the
running daemon and its host. Each check is a small function of what the daemon reports (its
API: /v1/status, /v1/doctor, /metrics, a bounded POST /v1/peers/probe) or of the host (GPU,
CPU) and returns one `Check`: ok / warn / fail, the figure, and what to do. The CLI formats."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvstreamd.client import Client, ClientError

OK, WARN, FAIL = "ok", "warn", "fail"
EXIT = {OK: 0, WARN: 1, FAIL: 2}  # the exit status: the worst check's

# Thresholds, each a warn (none is a law of nature; each says where it comes from).
GPU_BUSY_PERCENT = 90  # a GPU this busy decodes chunks behind the model's own kernels
MIN_PEER_MBIT = 100.0  # README: 4096 SmolLM2 tokens land in ~2 s at 100 Mbit/s; slower links miss that
MAX_CLOCK_OFFSET_S = 1.0  # past this, logs and chunk times across hosts no longer line up
MIN_HIT_RATE = 0.5  # under half of prompt tokens from KV: most of each prompt is prefilled
STORE_FULL = 0.9  # a store this full that evicts loses contexts before they are reused
PINS_FULL = 0.9  # pins this close to [store] pin_budget refuse new ones
DEGRADED_DISK = ("disk_full", "disk_error")


@dataclass(frozen=True)
class Check:
    name: str  # what was checked ("peer a", "decode rate")
    status: str  # OK, WARN or FAIL
    figure: str  # what was measured or found
    advice: str = ""  # what to do; empty when nothing needs doing
    data: dict = field(default_factory=dict)  # the figures as numbers, for --json readers

    def line(self) -> str:
        return f"{self.status:<4}  {self.name:<20}  {self.figure}" + (f"  -> {self.advice}" if self.advice else "")


def worst(checks: list[Check]) -> str:
    return max((c.status for c in checks), key=EXIT.__getitem__, default=OK)


def run(client: Client, probe_bytes: int | None = None, probe_timeout_s: float | None = None) -> list[Check]:
    """Every check, in the order an operator reads them. A daemon that cannot be reached is
    one FAIL (nothing else can be known)."""
    try:
        status = client.status()
        facts = client.doctor()
        probed = client.probe_peers(probe_bytes, probe_timeout_s)
        metrics = client.metrics()
    except ClientError as e:
        return [Check("daemon", FAIL, f"cannot ask it: {e}",
                      "is it running (systemctl status kvstreamd)? --socket or $KVSTREAMD_SOCKET name its socket")]
    return [daemon(status), gpu(facts["gpu"]), cpu(), decode(facts["decode"]), *peers(probed),
            damaged_chunks(facts), hit_rate(metrics), store(status), pins(status["store"]),
            certificate(status.get("certificate")), *profiles(facts["models"]), clocks(probed)]


def to_json(checks: list[Check]) -> dict:
    status = worst(checks)
    return {"status": status, "exit": EXIT[status], "checks": [asdict(c) for c in checks]}


# -- the checks ---------------------------------------------------------------------------------

def daemon(status: dict) -> Check:
    health = status["health"]
    figure = f"node {status['node_id']}, version {status['version']}, up {status['uptime_s']:g} s"
    if health["status"] == "ok":
        return Check("daemon", OK, figure)
    faults = "; ".join(f"{f['reason']}: {f['message']}" for f in health.get("degraded", []))
    return Check("daemon", WARN, f"{figure}, {health['status']}: {faults or 'no reason given'}",
                 "it still serves; the checks below say which part is short")


def gpu(daemon_gpu: dict, nvidia_smi: str = "nvidia-smi") -> Check:
    """nvidia-smi where there is one. No GPU is OK: kvstreamd decodes on its CPU workers by
    design (a GPU is an option, README "On a GPU host"), and the decode check says whether the
    CPU is fast enough."""
    used = daemon_gpu.get("device")
    exe = shutil.which(nvidia_smi)
    if exe is None:
        if used:
            return Check("gpu", OK, f"the daemon decodes on {used} (no nvidia-smi to read its utilisation)")
        return Check("gpu", OK, "no GPU (no nvidia-smi): decode runs on the CPU workers")
    try:
        out = subprocess.run([exe, "--query-gpu=index,name,utilization.gpu,memory.used,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check("gpu", WARN, f"nvidia-smi did not answer: {e}", "check the NVIDIA driver (nvidia-smi)")
    if out.returncode != 0:
        why = (out.stderr or out.stdout).strip().splitlines()[-1:] or [f"exit {out.returncode}"]
        return Check("gpu", WARN, f"nvidia-smi failed: {why[0]}", "check the NVIDIA driver (nvidia-smi)")
    gpus = [[f.strip() for f in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]
    if not gpus:
        return Check("gpu", OK, "nvidia-smi lists no GPU: decode runs on the CPU workers")
    shown = ", ".join(f"{g[0]}: {g[1]} {g[2]}% busy, {g[3]}/{g[4]} MiB" for g in gpus)
    busy = [g[0] for g in gpus if g[2].isdigit() and int(g[2]) >= GPU_BUSY_PERCENT]
    if not used:
        return Check("gpu", WARN, f"{shown}; the daemon decodes on the CPU: {daemon_gpu.get('why_not')}",
                     "install CuPy with CUDA (README \"On a GPU host\") and leave [codec] device = \"auto\"")
    if busy:
        return Check("gpu", WARN, f"{shown}; the daemon decodes on {used}",
                     f"GPU {', '.join(busy)} is {GPU_BUSY_PERCENT}%+ busy: chunks decode behind the model's work")
    return Check("gpu", OK, f"{shown}; the daemon decodes on {used}")


def cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> Check:
    """The vector instructions the CPU has, and what torch (every decode's inverse transforms)
    dispatches to: without AVX2 (x86) it runs its scalar kernels."""
    import torch

    used = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    have = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("asimd", "NEON")) if flag in flags]
    figure = f"{', '.join(have) or 'no AVX2 or AVX-512'} ({'/proc/cpuinfo' if flags else 'flags unknown'}); " \
             f"torch runs {used}"
    if used == "DEFAULT" and "asimd" not in flags:
        return Check("cpu", WARN, figure, "decode speed depends on AVX2: run the daemon on a host whose CPU has it")
    return Check("cpu", OK, figure)


def decode(d: dict) -> Check:
    """This host's measured decode rate (the daemon's moving average over its CPU decodes)
    against what one core does on the reference machine and the benchmarks' floor."""
    workers, mbps = d["workers"], d["mbps"]
    expected, floor = d["expected_mbps_per_core"], d["floor_mbps_per_core"]
    if d["entropy_coder"] != "C":
        return Check("decode rate", FAIL, "the entropy coder runs in NumPy (its C library did not build): "
                     "~100x slower", "install gcc (make install does) and restart the daemon")
    if not d["samples"]:
        return Check("decode rate", OK, f"not measured yet: no chunk over 1 MB decoded since start or stored "
                     f"(expected {expected:g} MB/s per core)")
    per = mbps / max(workers, 1)
    how = f"measured now on {d['measured_now']}" if d.get("measured_now") else f"{d['samples']} decodes"
    figure = (f"{mbps:g} MB/s with {workers} worker{'s' * (workers != 1)} ({per:.0f} per worker; expected "
              f"{expected:g} per core, floor {floor:g}; {how})")
    if per < floor:
        return Check("decode rate", WARN, figure, "decode is slow on this host: see the cpu line; other work on "
                     "these cores? [codec] workers above the cores this host has?", d)
    return Check("decode rate", OK, figure, data=d)


def peers(probed: list[dict]) -> list[Check]:
    """Each peer: reachable, its round trip and the bandwidth a bounded probe measured now."""
    if not probed:
        return [Check("peers", OK, "none configured or connected")]
    return [replace(_peer(p), data=p) for p in probed]


def _peer(p: dict) -> Check:
    name = f"peer {p['node_id'] or p['address']}"
    where = p["address"] or "(address not known here)"
    if not p["connected"]:
        if p["configured"]:
            why = p["last_error"] or p["error"] or "not connected"
            return Check(name, FAIL, f"{where} unreachable: {why}",
                         "is kvstreamd running there, its [peer] listen reachable from here, the secret the same?")
        if p["last_error"]:
            return Check(name, WARN, f"{where} not connected; its last dial failed: {p['last_error']}",
                         "fetches from it fail until it answers")
        return Check(name, OK, f"{where} not connected (dialled when a fetch needs it)")
    if p["error"]:
        return Check(name, FAIL, f"{where} connected, but the probe failed: {p['error']}",
                     "the link or the peer is stalled: check its load and the network")
    figure = f"{where} rtt {p['rtt_ms']:g} ms, {p['mbit']:g} Mbit/s from here (probe)"
    if p["cooldown_s"]:
        return Check(name, WARN, f"{figure}; avoided for {p['cooldown_s']:g} s more after stalling a fetch",
                     "see the daemon's log for 'stalled'")
    if p["mbit"] < MIN_PEER_MBIT:
        return Check(name, WARN, figure, f"under {MIN_PEER_MBIT:g} Mbit/s: long contexts miss a 2 s deadline; "
                                         "check the link (and what else uses it)")
    return Check(name, OK, figure)


def damaged_chunks(facts: dict) -> Check:
    """Chunks that failed the wire crc, admission or decode in the last hour: a peer's (or,
    rarely, a local one that does not decode)."""
    damaged = facts["damaged_chunks"]
    n = sum(damaged.values())
    hours = facts["window_s"] / 3600
    when = f"in the last {'hour' if hours == 1 else f'{hours:g} h'}"
    if not n:
        return Check("damaged chunks", OK, f"none {when}", data={"count": 0, "window_s": facts["window_s"]})
    floor = "" if facts["errors_complete"] else "at least "
    kinds = ", ".join(f"{k} {v}" for k, v in damaged.items())
    return Check("damaged chunks", WARN, f"{floor}{n} {when} ({kinds}); each came again as text",
                 "the daemon's log names the peer ('does not decode', 'not the chunk asked'): check its disk "
                 "and memory, and that every host has the same profile files",
                 {"count": n, "by_kind": damaged, "complete": facts["errors_complete"], "window_s": facts["window_s"]})


def hit_rate(metrics_text: str) -> Check:
    """Prompt tokens served from KV (local or peer) over all prompt tokens looked up, since start."""
    by_source: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "kvstreamd_prompt_tokens":
            for s in family.samples:
                if s.name.endswith("_total"):
                    src = s.labels["source"]  # summed over the other labels (the A/B arm)
                    by_source[src] = by_source.get(src, 0.0) + s.value
    total = sum(by_source.values())
    if not total:
        return Check("hit rate", OK, "no prompt looked up since start")
    kv = by_source.get("local", 0) + by_source.get("peer", 0)
    rate = kv / total
    figure = (f"{rate:.0%} of {total:.0f} prompt tokens from KV since start "
              f"(local {by_source.get('local', 0):.0f}, peer {by_source.get('peer', 0):.0f}, "
              f"text {by_source.get('text', 0):.0f}, prefill {by_source.get('prefill', 0):.0f})")
    data = {"rate": round(rate, 4), "tokens": by_source}
    if rate < MIN_HIT_RATE:
        return Check("hit rate", WARN, figure, "most prompt tokens are prefilled: are contexts put before they are "
                     "reused, and kept (see the store line's evictions)?", data)
    return Check("hit rate", OK, figure, data=data)


def store(status: dict) -> Check:
    return replace(_store(status), data=status["store"])


def _store(status: dict) -> Check:
    s = status["store"]
    faults = [f for f in status["health"].get("degraded", []) if f["reason"] in DEGRADED_DISK]
    tiers = [(name, s[f"{name}_bytes"], s[f"{name}_budget"]) for name in ("disk", "memory")]
    figure = ", ".join(f"{name} {_size(used)} of {_size(budget)}" + (f" ({used / budget:.0%})" if budget else "")
                       for name, used, budget in tiers)
    figure += f"; {s['chunks']} chunks, {s['evictions']} evictions, {s['disk_errors']} disk errors since start"
    if faults:
        return Check("store", FAIL, f"{figure}; {faults[0]['reason']}: {faults[0]['message']}",
                     "free or fix the store's disk ([store] dir): chunks are held in memory only meanwhile")
    full = [name for name, used, budget in tiers if budget and used >= STORE_FULL * budget]
    if full and s["evictions"]:
        return Check("store", WARN, figure, f"the {' and '.join(full)} tier is full and evicts: raise "
                                            f"[store] {full[0]}_budget so contexts last until reused")
    if s["disk_errors"]:
        return Check("store", WARN, figure, "chunk files failed to write or read: see the daemon's log")
    return Check("store", OK, figure)


def pins(s: dict) -> Check:
    """Lasting pins against [store] pin_budget, where the daemon has them (pinned_bytes, pin_budget)."""
    return replace(_pins(s), data={k: s.get(k) for k in ("pinned_bytes", "pin_budget", "pinned")})


def _pins(s: dict) -> Check:
    budget, pinned = s.get("pin_budget"), s.get("pinned_bytes")
    if not budget:
        return Check("pins", OK, f"no pin budget; {s.get('pinned', 0)} chunks pinned for transfers now")
    figure = f"{_size(pinned or 0)} of {_size(budget)} pinned ({(pinned or 0) / budget:.0%})"
    if (pinned or 0) >= PINS_FULL * budget:
        return Check("pins", WARN, figure, "new pins will be refused: unpin contexts or raise [store] pin_budget")
    return Check("pins", OK, figure)


def certificate(section: dict | None) -> Check:
    """The peer links' certificate and CA (/v1/status "certificate", kvstreamd/ops/certificates.py):
    FAIL once one is expired or not valid yet (peers refuse this node), WARN within its
    expires_soon_days, else OK; plaintext links have none to check."""
    if not section:
        return Check("certificate", OK, "plaintext peer links: no certificate to expire")
    files = section["files"]
    data = {f["setting"]: {"not_after": f["not_after"], "days_left": f["days_left"], "state": f["state"]}
            for f in files}
    refused = [f for f in files if f["state"] in ("expired", "not_yet_valid")]
    soon = [f for f in files if f["state"] == "expires_soon"]
    if refused:
        return Check("certificate", FAIL, "; ".join(f["message"] for f in refused),
                     "renew the file (README, \"TLS\") and restart the daemon", data)
    if soon:
        return Check("certificate", WARN, "; ".join(f["message"] for f in soon),
                     "renew it before it ends, then restart the daemon", data)
    first = min(files, key=lambda f: f["days_left"])
    return Check("certificate", OK, f"{first['setting']} ends first, in {first['days_left']:.0f} days", data=data)


def profiles(models: list[dict]) -> list[Check]:
    """Each stored model has a profile here (else its chunks cannot be coded or decoded)."""
    if not models:
        return [Check("profiles", OK, "no contexts stored")]
    out = []
    for m in models:
        name = f"profile {m['model_id'][:40]}"
        held = f"{m['contexts']} contexts, {m['chunks']} chunks"
        p = m["profile"]
        if p is None:
            out.append(Check(name, FAIL, f"{held}; no profile here: {m.get('profile_error')}",
                             "set [codec] profile to this model's .kvprofile, or put it in the daemon's user profile "
                             "folder (kvstreamd profile calibrate makes one; README.md \"Profiles\")", m))
            continue
        out.append(Check(name, OK, f"{held}; {p['source']} profile {p['id'][:16]} "
                                   f"({p['layers']} layers x {p['heads']} KV heads x {p['head_dim']})", data=m))
    return out


def clocks(probed: list[dict]) -> Check:
    """How far each peer's clock is from ours (PONG's wall clock, at the probe)."""
    offsets = {p["node_id"]: p["clock_offset_ms"] / 1000 for p in probed if p.get("clock_offset_ms") is not None}
    if not offsets:
        told = any(p["connected"] and not p["error"] for p in probed)
        return Check("clock offset", OK, "peers do not report their clock" if told else "no peer connected")
    far = {n: o for n, o in offsets.items() if abs(o) >= MAX_CLOCK_OFFSET_S}
    peer, off = max(offsets.items(), key=lambda kv: abs(kv[1]))
    figure = f"{peer}'s clock {off * 1000:+.1f} ms from this host's, the largest of {len(offsets)} " \
             f"peer{'s' * (len(offsets) != 1)}"
    data = {"offset_s": offsets}
    if far:
        return Check("clock offset", WARN, f"{figure}; over {MAX_CLOCK_OFFSET_S:g} s: "
                     + ", ".join(f"{n} {o:+.1f} s" for n, o in far.items()),
                     "run NTP (chrony, systemd-timesyncd) on every host", data)
    return Check("clock offset", OK, figure, data=data)


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
