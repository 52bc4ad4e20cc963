"""What answers at a SuperNode's ``--superlink`` address, found out by fedcond itself.

``flower-supernode`` reports a SuperLink it cannot use in words that rarely say why: a wrong
``--root-certificates`` and a certificate naming another host are both "SSL/TLS handshake error",
a plain-HTTP SuperLink dialled over TLS and a SuperLink that is not there are both retried as
"Connection attempt failed". ``probe`` dials the address as the node does (a TCP connection, then a
TLS handshake verifying against the node's CA file and the host it dials) and says in one line which
of these it is, naming the CA file and what the certificate presented names.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509

#: Seconds each step of the probe may take (the TCP connection, the TLS handshake).
PROBE_TIMEOUT = 5.0
#: OpenSSL's verify codes for a certificate that does not name what was dialled
#: (X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH).
NAME_MISMATCH = frozenset({62, 64})
FIX_CA = "give this node the ca.crt that signed the SuperLink's (or its proxy's) server.pem"


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets) as Flower's ``--superlink`` takes it; ValueError otherwise."""
    host, separator, port = address.rpartition(":")
    if not separator or not host or not port.isdigit():
        raise ValueError(address)
    return host.removeprefix("[").removesuffix("]"), int(port)


def unreachable(address: str, why: str) -> str:
    return (
        f"cannot reach the SuperLink at {address} (--superlink): {why}; check the address and port (on a network, "
        "the Fleet proxy's, docs/deployment.md), that the SuperLink runs and that no firewall blocks it; Flower "
        "keeps retrying"
    )


def probe(address: str, root_certificates: str | None) -> str | None:
    """One line (without fedcond's prefix) saying why a node given ``--superlink address`` and
    ``--root-certificates root_certificates`` (None: ``--insecure``) cannot use what answers there;
    None when a TLS handshake with it verifies (or, insecure, it answers without TLS): then the
    address is not the problem."""
    try:
        host, port = split_address(address)
    except ValueError:
        return f"--superlink {address} is not HOST:PORT; give the SuperLink's (or its Fleet proxy's) address and port"
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT).close()
    except TimeoutError:
        return unreachable(address, f"no answer within {PROBE_TIMEOUT:g} s (a firewall dropping it, or no such host)")
    except OSError as error:
        return unreachable(address, f"nothing accepts connections there ({error.strerror or error})")
    if root_certificates is None:
        if _presented_certificate(host, port) is None:
            return None  # it answers, and not over TLS: what an --insecure node needs
        return (
            f"the SuperLink at {address} talks TLS but this node was started with --insecure: give it "
            "--root-certificates ca.crt (the CA that signed the SuperLink's server.pem) instead"
        )
    return _check_tls(address, host, port, root_certificates)


def _check_tls(address: str, host: str, port: int, root_certificates: str) -> str | None:
    try:
        context = ssl.create_default_context(cafile=str(Path(root_certificates).expanduser()))
    except (OSError, ssl.SSLError) as error:
        return f"--root-certificates {root_certificates} is not a readable PEM certificate ({error}); {FIX_CA}"
    try:
        with (
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT) as connection,
            context.wrap_socket(connection, server_hostname=host),
        ):
            return None
    except ssl.SSLCertVerificationError as error:
        presented = _presented_certificate(host, port)
        if error.verify_code in NAME_MISMATCH:
            names = f" (it names {_names(_load(presented))})" if presented is not None else ""
            return (
                f"the certificate at {address} does not name {host}{names}: dial a name or address it holds in "
                f"--superlink, or make the SuperLink's certificate for {host} (scripts/generate-certificates.sh {host})"
            )
        certificate, authority, also = _unsigned(presented, root_certificates, host)
        return (
            f"the SuperLink at {address} answers, but {certificate} is not signed by --root-certificates "
            f"{root_certificates}{authority} ({error.verify_message}); {FIX_CA}{also}"
        )
    except ssl.SSLError as error:
        return (
            f"something answers at {address}, but not over TLS ({error.reason or error}): a SuperLink started with "
            "--insecure takes nodes started with --insecure (no --root-certificates); or dial its TLS port"
        )
    except TimeoutError:
        return f"something accepts connections at {address} but never completes a TLS handshake: is it the SuperLink?"
    except OSError as error:
        return f"something at {address} closed the connection during the TLS handshake ({error}): is it the SuperLink?"


def _presented_certificate(host: str, port: int) -> bytes | None:
    """The certificate (DER) whatever answers at host:port presents, unverified; None without TLS."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only to read what it presents: nothing is sent over it
    try:
        with (
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT) as connection,
            context.wrap_socket(connection, server_hostname=host) as tls,
        ):
            return tls.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError):
        return None


def _load(der: bytes) -> x509.Certificate:
    from cryptography import x509  # a dependency of Flower's: imported only when a probe needs it

    return x509.load_der_x509_certificate(der)


def _alt_names(certificate: x509.Certificate) -> x509.SubjectAlternativeName | None:
    """The certificate's subjectAltName, or None when it has none."""
    from cryptography import x509

    try:
        return certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None


def _names(certificate: x509.Certificate) -> str:
    """What a certificate names in its subjectAltName (``IP:...``, ``DNS:...``), else its CN."""
    from cryptography import x509

    extension = _alt_names(certificate)
    if extension is None:
        return f"CN={_common_name(certificate.subject)} only"
    names = [f"IP:{ip}" for ip in extension.get_values_for_type(x509.IPAddress)]
    names += [f"DNS:{name}" for name in extension.get_values_for_type(x509.DNSName)]
    return ", ".join(names) or "nothing"


def _common_name(name: x509.Name) -> str:
    from cryptography import x509

    values = name.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(values[0].value) if values else "?"


def _unsigned(der: bytes | None, root_certificates: str, host: str) -> tuple[str, str, str]:
    """What to say of a certificate the CA file did not verify: the certificate (its issuer and
    names), the CA file (when it holds a CA of the same name: another key), and whether the
    certificate fails to name the host dialled as well."""
    from cryptography import x509

    if der is None:
        return "its certificate", "", ""
    certificate = _load(der)
    issuer = _common_name(certificate.issuer)
    described = f"its certificate (issued by CN={issuer}, naming {_names(certificate)})"
    authority = ""
    try:
        authorities = x509.load_pem_x509_certificates(Path(root_certificates).expanduser().read_bytes())
    except (OSError, ValueError):
        authorities = []
    if any(candidate.subject == certificate.issuer for candidate in authorities):
        # scripts/generate-certificates.sh names every CA it makes fedcond-ca: same name, another key.
        authority = ", which holds another CA of that name (another key: made by another run of the script)"
    also = "" if _names_host(certificate, host) else f"; the certificate does not name {host} either"
    return described, authority, also


def _names_host(certificate: x509.Certificate, host: str) -> bool:
    from cryptography import x509

    extension = _alt_names(certificate)
    if extension is None:
        return False
    try:
        return ipaddress.ip_address(host) in extension.get_values_for_type(x509.IPAddress)
    except ValueError:  # a name, not an address
        return host.lower() in (name.lower() for name in extension.get_values_for_type(x509.DNSName))
