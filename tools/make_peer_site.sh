#!/usr/bin/env bash
# Builds .gpu-peers/: the frontier peers of the kernel suite for the offline GPU host (quack-kernels'
# RMSNorm / LayerNorm, FlashAttention 4's CuTe-DSL attention, and nvidia-cutlass-dsl under both), and
# activate.sh, which unpacks them there and puts them on PYTHONPATH.
#
#   bash tools/make_peer_site.sh            # here: downloads the wheels, writes .gpu-peers/ (about 3 minutes)
#
# The packages are 256 MB unpacked and 68 MB xz-compressed, more than one device call carries beside the
# tree (64 MiB in all), so the archive is split into parts of PART_MB (default 36) that travel in successive
# calls on one warm machine; every call sources the same activate.sh:
#   call 1: carry .gpu-peers/activate.sh .gpu-peers/key .gpu-peers/parts .gpu-peers/part-1
#           command: . .gpu-peers/activate.sh && ...   (keeps part 1 on the host, says 1 of 2 parts)
#   call 2: the same with .gpu-peers/part-2            (all parts there: unpacked, PYTHONPATH set)
# A machine given back in between loses the parts: start again from part 1.
# FBGEMM's table-batched embedding (fbgemm-gpu) is not bundled: its wheel is 498 MB, 2.8 GB unpacked.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
grep -qxF '/.gpu-peers/' .git/info/exclude 2>/dev/null || echo '/.gpu-peers/' >> .git/info/exclude
pkgs=(quack-kernels==0.6.5 flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
      nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5)
part_mb=${PART_MB:-36}
key=$(printf '%s\n' "${pkgs[@]}" "part_mb=$part_mb" | sha256sum | cut -c1-12)
mkdir -p .gpu-peers
if [[ -f .gpu-peers/parts && "$(cat .gpu-peers/key 2>/dev/null)" == "$key" ]]; then
  echo "up to date: .gpu-peers/ ($(cat .gpu-peers/parts) parts)"
  exit 0
fi
rm -f .gpu-peers/part-* .gpu-peers/parts .gpu-peers/key
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
plat=()
for n in 17 24 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" --platform manylinux2014_x86_64 --platform any -d "$tmp/whl" "${pkgs[@]}"
mkdir -p "$tmp/site"
for w in "$tmp"/whl/*.whl; do python3 -m zipfile -e "$w" "$tmp/site"; done
# the other platforms' runtime stubs (aarch64, QNX) are never loaded on the x86-64 host
rm -rf "$tmp"/site/nvidia_cutlass_dsl/cu13/lib/stubs
echo "compressing $(du -sh "$tmp/site" | cut -f1) of packages (about three minutes) ..."
tar -C "$tmp/site" -cf - . | xz -T0 -9 > "$tmp/site.tar.xz"
split -b "${part_mb}M" -d -a 1 --numeric-suffixes=1 "$tmp/site.tar.xz" .gpu-peers/part-
ls .gpu-peers/part-* | wc -l | tr -d ' ' > .gpu-peers/parts
echo "$key" > .gpu-peers/key
cat > .gpu-peers/activate.sh <<'ACT'
# Source me on the GPU host from the repo root in each call that carries a part (tools/make_peer_site.sh).
_key=$(cat .gpu-peers/key); _n=$(cat .gpu-peers/parts); _site=/tmp/gpu-peers-$_key
if [ ! -d "$_site" ]; then
  mkdir -p "$_site.parts"
  for _p in .gpu-peers/part-*; do [ -f "$_p" ] && cp "$_p" "$_site.parts/"; done
  _have=$(ls "$_site.parts" | wc -l)
  if [ "$_have" -ge "$_n" ]; then
    mkdir -p "$_site.part" && cat "$_site".parts/part-* | xz -d | tar -C "$_site.part" -xf - \
      && mv "$_site.part" "$_site" && rm -rf "$_site.parts"
  else
    echo "gpu-peers: $_have of $_n parts on this machine; carry the next part in the next call"
  fi
fi
if [ -d "$_site" ]; then
  # nvidia-cutlass-dsl puts its packages on sys.path through a .pth file, which PYTHONPATH does not read
  export PYTHONPATH="$_site:$_site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu-peers: ready ($_site)"
fi
export PYTHONUNBUFFERED=1
ACT
echo "built .gpu-peers/: $(cat .gpu-peers/parts) parts of ${part_mb} MiB at most ($(du -ch .gpu-peers/part-* | tail -1 | cut -f1))"
