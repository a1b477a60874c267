"""A cluster CA and host certificates made with the `cryptography` package, for the tests and
the TLS benchmark (README "TLS" gives the same with openssl for a real cluster): `CA(dir)`
writes ca.pem and ca.key; `ca.host(name)` writes name.pem and name.key, signed by it, valid
for both ends of a peer link (serverAuth and clientAuth)."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostCert:
    cert: Path
    key: Path
    ca: Path  # the CA this host trusts (its own cluster's)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvstreamd test"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class CA:
    """A self-signed CA in `root`: ca.pem, ca.key (`name`: its file stem and CN)."""

    def __init__(self, root: Path, name: str = "ca", cn: str | None = None, days: int = 30):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.cn = cn or f"kvstreamd {name}"
        self.days = days
        self.key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(self.cn)).issuer_name(_name(self.cn))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=days))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.path = self.root / f"{name}.pem"
        self._write(self.cert, self.path)
        _write_key(self.key, self.root / f"{name}.key")

    @staticmethod
    def _write(cert, path: Path) -> None:
        from cryptography.hazmat.primitives import serialization

        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def host(self, name: str, addresses: tuple[str, ...] = ("127.0.0.1",), *,
             valid: tuple[datetime.datetime, datetime.datetime] | None = None) -> HostCert:
        """A certificate for host `name` (CN and DNS name), with `addresses` as IP names too
        (not needed by kvstreamd, which checks the chain, not the name), signed by this CA,
        valid from five minutes ago for the CA's days, or over `valid` (not before, not after)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import ExtendedKeyUsageOID

        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        alt = [x509.DNSName(name)] + [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
        cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(valid[0] if valid else now - datetime.timedelta(minutes=5))
                .not_valid_after(valid[1] if valid else now + datetime.timedelta(days=self.days))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(alt), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        paths = HostCert(self.root / f"{name}.pem", self.root / f"{name}.key", self.path)
        self._write(cert, paths.cert)
        _write_key(key, paths.key)
        return paths
