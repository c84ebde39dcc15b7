#!/usr/bin/env bash
# Installs the Debian packages listed in scripts/system-packages.txt, enabling bookworm-backports
# for those marked "backports". Idempotent: does nothing (and never runs apt-get update) when all
# packages are already installed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
list="$here/system-packages.txt"
bp_sources=/etc/apt/sources.list.d/bookworm-backports.sources

# QEMU runs as this unprivileged system user (runtime/privilege.py); created once, whatever
# the packages' state. Jailed QEMUs (runtime/jail.py, the default) run as uids of their own
# from AENV_VM_UID_RANGE (no passwd entries) with this user's group as a supplementary group.
vm_user=${AENV_QEMU_USER:-aenv-vm}
if [[ "$vm_user" != root ]] && ! id -u "$vm_user" >/dev/null 2>&1; then
  if [[ $(id -u) -ne 0 ]]; then
    echo "install-system: user $vm_user is missing; run as root" >&2
    exit 1
  fi
  useradd --system --user-group --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin "$vm_user"
  echo "install-system: created system user $vm_user"
fi

missing_main=()
missing_bp=()
while read -r name suite; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  if ! dpkg-query -W -f='${Status}' "$name" 2>/dev/null | grep -q "install ok installed"; then
    if [[ "${suite:-}" == backports ]]; then missing_bp+=("$name"); else missing_main+=("$name"); fi
  fi
done <"$list"

if (( ${#missing_main[@]} + ${#missing_bp[@]} == 0 )); then
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "install-system: missing packages ${missing_main[*]} ${missing_bp[*]}; run as root" >&2
  exit 1
fi
if (( ${#missing_bp[@]} )) && [[ ! -f $bp_sources ]]; then
  cat >"$bp_sources" <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi
export DEBIAN_FRONTEND=noninteractive
echo "install-system: installing ${missing_main[*]} ${missing_bp[*]}"
apt-get update -q
if (( ${#missing_bp[@]} )); then
  apt-get install -y -q --no-install-recommends -t bookworm-backports "${missing_bp[@]}"
fi
if (( ${#missing_main[@]} )); then
  apt-get install -y -q --no-install-recommends "${missing_main[@]}"
fi
# nfs-ganesha's Depends bring rpcbind (port 111 on every address) and Debian's own ganesha
# service; the node runs the one ganesha it needs (node/nfs.py, NFSv4 only) and no rpcbind. On a
# host with systemd, the packages' postinst started and enabled them: stop them for good.
if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
  for unit in rpcbind.socket rpcbind.service nfs-ganesha.service nfs-ganesha-lock.service; do
    if systemctl cat "$unit" >/dev/null 2>&1; then
      systemctl disable --now "$unit" >/dev/null 2>&1 || true
      systemctl mask "$unit" >/dev/null 2>&1 || true
    fi
  done
  echo "install-system: rpcbind and Debian's nfs-ganesha service stopped and masked (the node runs its own)"
fi
