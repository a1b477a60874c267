"""The node's TLS certificate and its cluster CA as time runs out on them.

A node whose certificate (or CA) has expired still starts and listens, but every peer refuses
its links, so the only symptom would be a cluster that no longer finds anything. This feature
reads the validity dates of `[peer] tls_cert` and `[peer] tls_ca` at start-up, when the peer
links load them (TLS files are not reloaded: a renewed certificate takes a restart), and says what it finds everywhere an operator looks:
- the log at start-up: an error for a certificate that is expired or not valid yet, a warning
  for one within EXPIRES_SOON_DAYS of its end;
- /healthz: degraded, reason "certificate", while one is expired or not valid yet;
- /v1/status "certificate" and so `kvstreamd doctor`: each file's dates and days left;
- GET /metrics: kvstreamd_tls_expiry_timestamp_seconds, when the first of them expires, which
  the rule KvstreamdCertificateExpiresSoon alerts on EXPIRES_SOON_DAYS ahead (a test holds
  the rule to this constant).
Without TLS (plaintext links) it has nothing to watch: no status, gauge 0."""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from pathlib import Path

from kvstreamd.config import Config
from kvstreamd.features import Feature

log = logging.getLogger(__name__)

EXPIRES_SOON_DAYS = 14  # the log warns and the alert fires this long before a certificate ends
_DAY = 86400.0

# A certificate's state, as /v1/status and doctor say it. The first two make the node degraded:
# its peers refuse it (or it refuses them, for the CA) now.
EXPIRED, NOT_YET_VALID, EXPIRES_SOON, VALID = "expired", "not_yet_valid", "expires_soon", "valid"
_REFUSED = (EXPIRED, NOT_YET_VALID)


@dataclass(frozen=True)
class Certificate:
    """The first certificate of one of the node's PEM files (its own leaf, or the CA)."""

    setting: str  # "[peer] tls_cert" or "[peer] tls_ca"
    path: Path
    subject: str
    not_before: datetime.datetime
    not_after: datetime.datetime

    def state(self, now: datetime.datetime) -> str:
        if now >= self.not_after:
            return EXPIRED
        if now < self.not_before:
            return NOT_YET_VALID
        if (self.not_after - now).total_seconds() < EXPIRES_SOON_DAYS * _DAY:
            return EXPIRES_SOON
        return VALID

    def says(self, now: datetime.datetime) -> str:
        """The certificate's state in one sentence naming the setting and the file."""
        state, end = self.state(now), self.not_after.strftime("%Y-%m-%d %H:%M UTC")
        what = f"{self.setting} {str(self.path)!r} ({self.subject})"
        if state == EXPIRED:
            return f"{what} expired on {end}: peers refuse this node's links until it is renewed"
        if state == NOT_YET_VALID:
            return (f"{what} is not valid before {self.not_before:%Y-%m-%d %H:%M} UTC (check this host's "
                    f"clock): peers refuse this node's links until then")
        days = (self.not_after - now).total_seconds() / _DAY
        if state == EXPIRES_SOON:
            return f"{what} expires on {end}, in {days:.1f} days: renew it and reload"
        return f"{what} is valid until {end} ({days:.0f} days)"

    def to_json(self, now: datetime.datetime) -> dict:
        return {"setting": self.setting, "path": str(self.path), "subject": self.subject,
                "not_before": self.not_before.isoformat(), "not_after": self.not_after.isoformat(),
                "days_left": round((self.not_after - now).total_seconds() / _DAY, 2),
                "state": self.state(now), "message": self.says(now)}


def read(setting: str, path: Path) -> Certificate:
    """The first certificate in PEM file `path` (the daemon loaded the file already, so it
    parses; OSError or ValueError if it changed since)."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificates(Path(path).read_bytes())[0]
    return Certificate(setting, Path(path), cert.subject.rfc4514_string() or "(empty subject)",
                       cert.not_valid_before_utc, cert.not_valid_after_utc)


def now_utc() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class CertificateWatch(Feature):
    """Watches [peer] tls_cert and tls_ca; see the module's docstring."""

    name = "certificate"

    def __init__(self, cfg: Config, metrics) -> None:
        self.metrics = metrics  # kvstreamd.metrics.Metrics: the expiry gauge
        self.certificates: list[Certificate] = []
        self._read(cfg)

    def _read(self, cfg: Config) -> None:
        p = cfg.peer
        certs = []
        if p.tls_cert is not None and p.tls_ca is not None:
            for setting, path in (("[peer] tls_cert", p.tls_cert), ("[peer] tls_ca", p.tls_ca)):
                try:
                    certs.append(read(setting, path))
                except (OSError, ValueError, IndexError) as e:  # changed on disk since it loaded
                    log.warning("%s %r: cannot read its dates: %s", setting, str(path), e)
        self.certificates = certs
        first = min((c.not_after for c in certs), default=None)
        self.metrics.tls_expiry.set(first.timestamp() if first else 0)

    async def start(self) -> None:
        now = now_utc()
        for c in self.certificates:
            state = c.state(now)
            level = (logging.ERROR if state in _REFUSED else logging.WARNING if state == EXPIRES_SOON
                     else logging.INFO)
            log.log(level, "%s", c.says(now))

    def status(self) -> dict | None:
        if not self.certificates:
            return None
        now = now_utc()
        return {"expires_soon_days": EXPIRES_SOON_DAYS, "files": [c.to_json(now) for c in self.certificates]}

    def degraded(self) -> list[dict]:
        now = now_utc()
        return [{"reason": "certificate", "message": c.says(now)} for c in self.certificates
                if c.state(now) in _REFUSED]
