#!/usr/bin/env bash
# Make one SuperNode authentication key pair per NAME: what Flower's SuperNode authentication needs.
#
#   scripts/generate-supernode-keys.sh OUTDIR NAME [NAME...]     e.g.  keys supernode-0 supernode-1
#
# Writes OUTDIR/NAME (the private key: it stays on that client machine, readable by its owner only,
# passed to `flower-supernode --auth-supernode-private-key`) and OUTDIR/NAME.pub (the public key:
# the SuperLink's operator registers it with `flwr supernode register OUTDIR/NAME.pub <connection>`).
# The keys are ECDSA on NIST P-384 in OpenSSH format, as Flower 1.42 requires. A SuperLink started
# with --enable-supernode-auth refuses every SuperNode whose public key was not registered.
# Refuses to run, writing nothing, where any of the files exists already: a replaced private key
# would lock that node out until its new public key is registered.
set -euo pipefail

if [[ $# -lt 2 || -z "${1:-}" ]]; then
    echo "usage: $0 OUTDIR NAME [NAME...]" >&2
    exit 2
fi
outdir="$1"
shift
command -v ssh-keygen >/dev/null || {
    echo "fedcond: error: ssh-keygen not found; install it (apt-get install openssh-client)" >&2
    exit 2
}
for name in "$@"; do
    if [[ ! "$name" =~ ^[A-Za-z0-9._-]+$ ]]; then
        echo "fedcond: error: key name '$name' may hold only letters, digits, '.', '_' and '-'" >&2
        exit 2
    fi
    for file in "$outdir/$name" "$outdir/$name.pub"; do
        if [[ -e "$file" ]]; then
            echo "fedcond: error: $file exists; keep it (its public key may be registered), or choose another OUTDIR" >&2
            exit 1
        fi
    done
done
mkdir -p "$outdir"
umask 077  # the private keys are their owner's alone
for name in "$@"; do
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "$name" -f "$outdir/$name"
    chmod 644 "$outdir/$name.pub"
done
echo "SuperNode keys in ${outdir}: NAME (private, stays on that node) and NAME.pub (register it on the SuperLink) for $*"
