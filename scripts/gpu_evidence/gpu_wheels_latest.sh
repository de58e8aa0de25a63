#!/usr/bin/env bash
# The newest transformers our pins accept, for the GPU machine: ../shared/tools/gpu_wheels.sh pins
# transformers 5.22.2 + kernels 0.17.2 (its `base`), while a fresh install (CI, users) resolves
# transformers 5.25 + kernels 0.19 + huggingface_hub 2.4. This fills `.gpu-wheels/latest` (ignored
# by git, ~30 MiB) with those releases and the dependencies the GPU image lacks or has too old;
# carry it next to `base` and scripts/gpu_evidence/gpu_evidence.sh installs it over base's
# transformers/kernels:
#
#   bash scripts/gpu_evidence/gpu_wheels_latest.sh      # here, from the project root
#   bash scripts/gpu_evidence/gpu_evidence.sh ...       # there, with .gpu-wheels/{base,latest}
#
# numpy, packaging, PyYAML, filelock, fsspec and typing_extensions are left to the image (torch
# depends on them; the releases it has satisfy these pins).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
# never committed: .gitignore names /.gpu-wheels/ (a worktree's .git is a file: ask git where)
git check-ignore -q .gpu-wheels/latest || echo '/.gpu-wheels/' >> "$(git rev-parse --git-path info/exclude)"
dest=.gpu-wheels/latest
rm -rf "$dest"
mkdir -p "$dest"
pins=(transformers==5.25.0 kernels==0.19.1 huggingface_hub==2.4.0)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
report=$(mktemp)
# the dependency closure as pip resolves it for the GPU machine's Python, then the wheels themselves
quiet() { grep -v '^WARNING: Location' || true; }  # this machine's pip config names absent indexes
python3 -m pip install -q --dry-run --ignore-installed --report "$report" "${plat[@]}" \
    --target "$(mktemp -d)" "${pins[@]}" 2>&1 | quiet
mapfile -t wanted < <(python3 - "$report" <<'PY'
import json, sys
skip = {"numpy", "packaging", "pyyaml", "filelock", "fsspec", "typing-extensions"}
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    if meta["name"].lower().replace("_", "-") not in skip:
        print(f"{meta['name']}=={meta['version']}")
PY
)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dest" "${wanted[@]}" 2>&1 | quiet
rm -f "$report"
du -sh "$dest"
