#!/usr/bin/env bash
# Make a private CA and a SuperLink server certificate for one host name or IP address.
#
#   scripts/generate-certificates.sh HOST_OR_IP [OUTDIR]      (OUTDIR defaults to ./certificates)
#
# Writes OUTDIR/ca.crt (give it to every SuperNode and to `flwr`), OUTDIR/ca.key (keep it private;
# it signs server certificates), OUTDIR/server.pem and OUTDIR/server.key (the SuperLink's). The
# server certificate names HOST_OR_IP in its subjectAltName (IP:... for an address, DNS:... for a
# name), which is what SuperNodes check: use the address they dial in --superlink. 127.0.0.1 and
# localhost are always added so the SuperLink's own ServerApp can reach it on loopback.
# Refuses to run where OUTDIR/ca.key exists already. For trials and small studies; follow your
# organisation's PKI for anything long-lived.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || -z "${1:-}" ]]; then
    echo "usage: $0 HOST_OR_IP [OUTDIR]" >&2
    exit 2
fi
host="$1"
outdir="${2:-certificates}"
command -v openssl >/dev/null || { echo "fedcond: error: openssl not found; install it (apt-get install openssl)" >&2; exit 2; }

# An IPv4/IPv6 literal goes in as IP:, anything else as DNS:.
if [[ "$host" =~ ^[0-9.]+$ || "$host" == *:* ]]; then
    san="IP:${host}"
else
    san="DNS:${host}"
fi
for extra in "IP:127.0.0.1" "DNS:localhost"; do
    [[ "$san" == "$extra" ]] || san="${san},${extra}"
done

# A new CA key would orphan every certificate the old one signed (SuperNodes trusting the old ca.crt
# could no longer reach the SuperLink): never replace one silently.
if [[ -e "$outdir/ca.key" ]]; then
    echo "fedcond: error: $outdir/ca.key exists; keep it, or move $outdir away (or choose another OUTDIR) to make a new CA" >&2
    exit 1
fi
mkdir -p "$outdir"
umask 077  # private keys readable by their owner only
days=365
openssl req -x509 -newkey rsa:2048 -nodes -days "$days" -sha256 \
    -keyout "$outdir/ca.key" -out "$outdir/ca.crt" -subj "/CN=fedcond-ca" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -sha256 \
    -keyout "$outdir/server.key" -out "$outdir/server.csr" -subj "/CN=${host}" 2>/dev/null
extensions="$(mktemp)"
trap 'rm -f "$extensions"' EXIT
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
    "$san" >"$extensions"
openssl x509 -req -in "$outdir/server.csr" -CA "$outdir/ca.crt" -CAkey "$outdir/ca.key" -CAcreateserial \
    -days "$days" -sha256 -extfile "$extensions" -out "$outdir/server.pem" 2>/dev/null
rm -f "$outdir/server.csr" "$outdir/ca.srl"
chmod 644 "$outdir/ca.crt" "$outdir/server.pem"
echo "certificates for ${san} in ${outdir}: ca.crt (SuperNodes, flwr), server.pem + server.key + ca.crt (SuperLink)"
