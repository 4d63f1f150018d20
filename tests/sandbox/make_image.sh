#!/usr/bin/env bash
# make_image.sh ENGINE TAG: a minimal image for the container backend's tests, made from this
# host's own /usr/bin/python3 (its standard library, the shared libraries it and its extension
# modules load) and dash, imported with `ENGINE import` (no registry: the tests run offline).
set -euo pipefail
engine=$1 tag=$2
py=$(readlink -f /usr/bin/python3)
stdlib=$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
copy() { (cd "$root" && cp -a --parents "$1" .); }
bins="$py /usr/bin/dash /usr/bin/ls /usr/bin/cat /usr/bin/sleep /usr/bin/id $(ls "$stdlib"/lib-dynload/*.so)"
for b in $bins; do
  copy "$b"
  for lib in $(ldd "$b" | grep -o '/[^ ]*\.so[^ ]*'); do
    copy "$(readlink -f "$(dirname "$lib")")/$(basename "$lib")"  # the name it is loaded by
    copy "$(readlink -f "$lib")"                                    # the file that name links to
  done
done
[ -e /usr/lib64 ] && copy /usr/lib64
tar -C / -cf - --exclude="${stdlib#/}/test" --exclude='*/__pycache__' "${stdlib#/}" | tar -C "$root" -xf -
mkdir -p "$root/usr/bin"
ln -sf usr/bin "$root/bin"; ln -sf usr/lib "$root/lib"; ln -sf usr/lib64 "$root/lib64"
ln -sf "$(basename "$py")" "$root/usr/bin/python3"; ln -sf dash "$root/usr/bin/sh"
chmod -R a+rX "$root"; chmod 755 "$root"
tar -C "$root" -cf - . | "$engine" import - "$tag" >/dev/null
