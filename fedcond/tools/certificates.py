"""TLS for a real deployment: a private CA and a SuperLink certificate, by the same script
(``scripts/generate-certificates.sh``) the deployment guide has users run by hand."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from fedcond.errors import FedcondError
from fedcond.tools.flwr_commands import app_directory

CERTIFICATE_SCRIPT = Path("scripts") / "generate-certificates.sh"


@dataclass(frozen=True)
class Certificates:
    """The PEM files ``scripts/generate-certificates.sh`` writes."""

    ca: Path  # every SuperNode and `flwr` trust this
    server_cert: Path  # the SuperLink's certificate, naming its host in subjectAltName
    server_key: Path

    @classmethod
    def in_folder(cls, folder: Path) -> Certificates:
        return cls(folder / "ca.crt", folder / "server.pem", folder / "server.key")


def generate_certificates(host: str, folder: Path) -> Certificates:
    """A private CA and a server certificate for ``host``."""
    if shutil.which("openssl") is None:
        raise FedcondError("openssl not found; install it (apt-get install openssl) or pass --insecure")
    script = app_directory() / CERTIFICATE_SCRIPT
    result = subprocess.run(["bash", str(script), host, str(folder)], capture_output=True, text=True)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise FedcondError(f"{script} failed ({reason}); run it by hand to see why")
    return Certificates.in_folder(folder)
