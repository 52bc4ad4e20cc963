"""``fedcond supernode``'s own probe of ``--superlink``: against small TLS and plain servers on 127.0.0.1."""

from __future__ import annotations

import datetime
import ipaddress
import re
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedcond.tools.deploy import LOOPBACK, free_ports
from fedcond.tools.superlink_probe import probe, split_address

ONE_DAY = datetime.timedelta(days=1)


Authority = tuple[ec.EllipticCurvePrivateKey, x509.Certificate]


def certificate_authority(folder: Path, name: str = "fedcond-ca") -> Authority:
    """A CA named CN=``name`` (scripts/generate-certificates.sh names every CA so), its ca.crt in ``folder``."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - ONE_DAY).not_valid_after(now + ONE_DAY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ca.crt").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return key, certificate


def server_certificate(folder: Path, authority: Authority, names: list[x509.GeneralName]) -> tuple[Path, Path]:
    """server.pem (naming ``names``, signed by ``authority``) and server.key in ``folder``."""
    ca_key, ca_certificate = authority
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "superlink")]))
        .issuer_name(ca_certificate.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - ONE_DAY).not_valid_after(now + ONE_DAY)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "server.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    (folder / "server.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return folder / "server.pem", folder / "server.key"


LOOPBACK_NAMES = [x509.IPAddress(ipaddress.ip_address(LOOPBACK)), x509.DNSName("localhost")]


@contextmanager
def server(certificate: tuple[Path, Path] | None) -> Iterator[str]:
    """A server on 127.0.0.1 that completes TLS handshakes with ``certificate`` (None: answers plain
    HTTP's 400, as a SuperLink started with --insecure answers a TLS hello); yields its address."""
    context = None
    if certificate is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*certificate)
    (port,) = free_ports(1)
    listener = socket.create_server((LOOPBACK, port))
    listener.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with connection:
                connection.settimeout(5)
                try:
                    if context is None:
                        connection.recv(1024)
                        connection.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    else:
                        with context.wrap_socket(connection, server_side=True) as tls:
                            tls.recv(1)  # until the client closes
                except (OSError, ssl.SSLError):
                    pass  # the client refused the certificate: what the probe is for

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"{LOOPBACK}:{port}"
    finally:
        done.set()
        thread.join(timeout=5)
        listener.close()


def test_the_probe_says_nothing_listens_at_an_address_nobody_serves():
    (port,) = free_ports(1)  # free: nothing listens there
    found = probe(f"{LOOPBACK}:{port}", None)
    assert found is not None and found.startswith(f"cannot reach the SuperLink at {LOOPBACK}:{port} (--superlink):")
    assert "nothing accepts connections there (Connection refused)" in found and "no firewall" in found


def test_the_probe_names_the_ca_file_that_did_not_sign_the_certificate_and_what_it_names(tmp_path):
    theirs = certificate_authority(tmp_path / "superlink")
    certificate = server_certificate(tmp_path / "superlink", theirs, LOOPBACK_NAMES)
    certificate_authority(tmp_path / "other")  # another CA of the same name: another run of the script
    wrong = str(tmp_path / "other" / "ca.crt")
    with server(certificate) as address:
        assert probe(address, str(tmp_path / "superlink" / "ca.crt")) is None  # the right CA: nothing to say
        found = probe(address, wrong)
    # OpenSSL's own words follow in brackets: "certificate signature failure" here, where the CA file's
    # CA has the issuer's name; "unable to get local issuer certificate" where key identifiers differ.
    assert found is not None and re.fullmatch(
        re.escape(
            f"the SuperLink at {address} answers, but its certificate (issued by CN=fedcond-ca, naming IP:127.0.0.1, "
            f"DNS:localhost) is not signed by --root-certificates {wrong}, which holds another CA of that name "
            "(another key: made by another run of the script) ("
        )
        + r"[a-z ]+"
        + re.escape("); give this node the ca.crt that signed the SuperLink's (or its proxy's) server.pem"),
        found,
    ), found


def test_the_probe_says_the_certificate_does_not_name_the_host_dialled(tmp_path):
    authority = certificate_authority(tmp_path / "ca")
    certificate = server_certificate(tmp_path / "ca", authority, [x509.DNSName("fl.example.org")])
    with server(certificate) as address:
        found = probe(address, str(tmp_path / "ca" / "ca.crt"))
    assert found == (
        f"the certificate at {address} does not name {LOOPBACK} (it names DNS:fl.example.org): dial a name or "
        f"address it holds in --superlink, or make the SuperLink's certificate for {LOOPBACK} "
        f"(scripts/generate-certificates.sh {LOOPBACK})"
    )


def test_the_probe_tells_a_plain_http_superlink_from_a_tls_one(tmp_path):
    authority = certificate_authority(tmp_path / "ca")
    with server(None) as address:
        assert probe(address, None) is None  # an --insecure node and an --insecure SuperLink: fine
        found = probe(address, str(tmp_path / "ca" / "ca.crt"))
    assert found is not None and found.startswith(f"something answers at {address}, but not over TLS (")
    assert "a SuperLink started with --insecure takes nodes started with --insecure" in found
    with server(server_certificate(tmp_path / "ca", authority, LOOPBACK_NAMES)) as address:
        found = probe(address, None)
    assert found is not None and "talks TLS but this node was started with --insecure" in found


def test_superlink_addresses_split_as_flower_takes_them():
    assert split_address("127.0.0.1:9092") == ("127.0.0.1", 9092)
    assert split_address("[::1]:9092") == ("::1", 9092)
    assert split_address("fl.example.org:443") == ("fl.example.org", 443)
    assert probe("fl.example.org", None) == (
        "--superlink fl.example.org is not HOST:PORT; give the SuperLink's (or its Fleet proxy's) address and port"
    )
