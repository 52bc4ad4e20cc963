"""Credentials for a real deployment, by the same scripts the deployment guide has users run by hand:
TLS (a private CA and a SuperLink certificate, ``scripts/generate-certificates.sh``) and one
SuperNode authentication key pair per node (``scripts/generate-supernode-keys.sh``)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from fedcond.errors import FedcondError
from fedcond.tools.flwr_commands import app_directory

CERTIFICATE_SCRIPT = Path("scripts") / "generate-certificates.sh"
NODE_KEY_SCRIPT = Path("scripts") / "generate-supernode-keys.sh"


@dataclass(frozen=True)
class Certificates:
    """The PEM files ``scripts/generate-certificates.sh`` writes."""

    ca: Path  # every SuperNode and `flwr` trust this
    server_cert: Path  # the SuperLink's certificate, naming its host in subjectAltName
    server_key: Path

    @classmethod
    def in_folder(cls, folder: Path) -> Certificates:
        return cls(folder / "ca.crt", folder / "server.pem", folder / "server.key")


@dataclass(frozen=True)
class NodeKey:
    """One SuperNode's authentication key pair (OpenSSH format, ECDSA P-384)."""

    private: Path  # stays on the node: flower-supernode --auth-supernode-private-key
    public: Path  # registered on the SuperLink: flwr supernode register

    @classmethod
    def in_folder(cls, folder: Path, name: str) -> NodeKey:
        return cls(folder / name, folder / f"{name}.pub")


def generate_certificates(host: str, folder: Path) -> Certificates:
    """A private CA and a server certificate for ``host``."""
    if shutil.which("openssl") is None:
        raise FedcondError("openssl not found; install it (apt-get install openssl) or pass --insecure")
    _run_script(CERTIFICATE_SCRIPT, [host, str(folder)])
    return Certificates.in_folder(folder)


def generate_node_keys(folder: Path, names: list[str]) -> list[NodeKey]:
    """A new key pair per name in ``folder``; refuses (writing nothing) where any key file exists."""
    if shutil.which("ssh-keygen") is None:
        raise FedcondError("ssh-keygen not found; install it (apt-get install openssh-client) or pass --insecure")
    _run_script(NODE_KEY_SCRIPT, [str(folder), *names])
    return [NodeKey.in_folder(folder, name) for name in names]


def _run_script(relative: Path, arguments: list[str]) -> None:
    script = app_directory() / relative
    result = subprocess.run(["bash", str(script), *arguments], capture_output=True, text=True)
    if result.returncode != 0:
        # The scripts' own errors are one line naming the fix: pass that line on as it is.
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("fedcond: error: ")
        if result.returncode == 1:
            raise FedcondError(reason)
        raise FedcondError(f"{script} failed ({reason}); run it by hand to see why")
