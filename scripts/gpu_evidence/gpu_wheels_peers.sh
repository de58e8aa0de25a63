#!/usr/bin/env bash
# The peers bench_e2e runs beside hf_varlen (scripts/e2e_peers.py), for the GPU machine (no
# network): Unsloth (unsloth, unsloth_zoo, trl 1.15.0: Unsloth pins transformers <= 5.17 and
# trl <= 1.15, bitsandbytes for its loader and QLoRA) and TRL + Liger (trl 1.15.0, liger-kernel),
# each with datasets and the dependencies the GPU image lacks. The image has Python 3.12, torch
# 2.11.0+cu130, triton 3.6.0, transformers 5.17.0, accelerate, peft, numpy, pandas, pyarrow and
# matplotlib (and what they depend on): those are left out, so each peer runs on the image's
# transformers 5.17.0 (hf_varlen's modes keep their own from .gpu-wheels/base).
#
#   bash scripts/gpu_evidence/gpu_wheels_peers.sh    # here, from the project root
#
# fills .gpu-wheels/peers/part1, part2, ... (ignored by git), each under HF_VARLEN_PART_MIB
# (default 40) MiB, so that one GPU call carries a part beside the tree (~2 MiB) and runs/shared
# (~14 MiB) under its 64 MiB; every part holds the two install lists (site_unsloth.txt,
# site_trl.txt).
# bitsandbytes ships one library per CUDA / ROCm release (43 MB): only its cuda13x and CPU ones
# are kept (the wheel is repacked, RECORD rewritten). xformers (declared by unsloth, optional for
# its 16-bit and full fine-tuning; no build for torch 2.11 loads) and torchvision stay out.
# On the GPU machine, with the parts carried (in one call or over calls while it stays warm):
#
#   bash scripts/gpu_evidence/gpu_evidence.sh peers_install OUT  # /tmp/peers/{unsloth,trl}
#   bash scripts/gpu_evidence/gpu_evidence.sh peers OUT          # the grid (see gpu_evidence.sh)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
# never committed: .gitignore names /.gpu-wheels/ (a worktree's .git is a file: ask git where)
git check-ignore -q .gpu-wheels/peers || echo '/.gpu-wheels/' >> "$(git rev-parse --git-path info/exclude)"
dest=.gpu-wheels/peers
pool=$(mktemp -d)
trap 'rm -rf "$pool"' EXIT
rm -rf "$dest"
mkdir -p "$dest"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_18_x86_64
      --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# The image's releases: the resolver picks every other package to fit them. torch, triton,
# torchvision and xformers resolve as empty stand-ins (local wheels, version +image), so the
# resolver neither walks torch's CUDA wheels nor searches xformers for one matching torch 2.11.
stubs="$pool/stubs"
python3 - "$stubs" <<'PY'
import os, sys, zipfile
out = sys.argv[1]
os.makedirs(out)
for name, version in [("torch", "2.11.0"), ("triton", "3.6.0"), ("torchvision", "0.26.0"),
                      ("xformers", "0.0.99")]:
    v = f"{version}+image"
    info = f"{name}-{v}.dist-info"
    with zipfile.ZipFile(f"{out}/{name}-{v}-py3-none-any.whl", "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {v}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
PY
image=(--find-links "$stubs" torch==2.11.0+image triton==3.6.0+image torchvision==0.26.0+image
       xformers==0.0.99+image transformers==5.17.0)
declare -A sites=(
    [unsloth]="unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets<5 bitsandbytes"
    [trl]="trl==1.15.0 datasets<5 liger-kernel==0.8.5"
)
quiet() { grep -v '^WARNING: Location' || true; }  # this machine's pip config names absent indexes
for site in "${!sites[@]}"; do
    report="$pool/report_$site.json"
    # shellcheck disable=SC2086  # the specs are words
    python3 -m pip install -q --dry-run --ignore-installed --report "$report" "${plat[@]}" \
        --target "$pool/t" ${sites[$site]} "${image[@]}" 2>&1 | quiet
    python3 - "$report" > "$pool/wanted_$site.txt" <<'PY'
import json, re, sys
# In the GPU image already (or deliberately left out: xformers, torchvision; see above).
image = re.compile(
    r"(torch|triton|nvidia-.*|cuda-.*|transformers|tokenizers|safetensors|huggingface-hub|hf-xet"
    r"|accelerate|peft|numpy|pandas|pyarrow|matplotlib|pillow|fonttools|contourpy|kiwisolver"
    r"|cycler|pyparsing|python-dateutil|pytz|tzdata|six|sympy|mpmath|networkx|jinja2|markupsafe"
    r"|regex|pyyaml|psutil|setuptools|packaging|filelock|typing-extensions|tqdm|torchvision"
    r"|xformers)"
)
for item in json.load(open(sys.argv[1]))["install"]:
    name = item["metadata"]["name"].lower().replace("_", "-")
    if not image.fullmatch(name):
        print(f"{name}=={item['metadata']['version']}")
PY
done
sort -u "$pool"/wanted_*.txt > "$pool/wanted.txt"
mkdir -p "$pool/w"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$pool/w" -r "$pool/wanted.txt" 2>&1 | quiet
# bitsandbytes: keep the CUDA 13 and CPU libraries only.
for whl in "$pool"/w/bitsandbytes-*.whl; do
    python3 - "$whl" <<'PY'
import os, re, sys, zipfile
src = sys.argv[1]
keep = re.compile(r"libbitsandbytes_(cuda13\d|cpu)\.")
tmp = src + ".tmp"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    dropped = {n for n in zin.namelist() if "libbitsandbytes_" in n and not keep.search(n)}
    for info in zin.infolist():
        if info.filename in dropped:
            continue
        data = zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):  # the removed files' lines out
            lines = data.decode().splitlines(keepends=True)
            data = "".join(l for l in lines if l.split(",")[0] not in dropped).encode()
        zout.writestr(info, data)
os.replace(tmp, src)
print(f"bitsandbytes: dropped {len(dropped)} libraries, {os.path.getsize(src) / 2**20:.1f} MiB")
PY
done
# The install list of each site: wheel file names.
for site in "${!sites[@]}"; do
    python3 - "$pool/w" "$pool/wanted_$site.txt" > "$pool/site_$site.txt" <<'PY'
import os, re, sys
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
files = {norm(f.split("-")[0]) + "==" + f.split("-")[1]: f for f in os.listdir(sys.argv[1])}
for line in open(sys.argv[2]):
    name, version = line.strip().split("==")
    print(files[norm(name) + "==" + version])
PY
done
# Parts under the limit: the largest wheels first, each into the first part it fits.
python3 - "$pool" "$dest" "${HF_VARLEN_PART_MIB:-40}" <<'PY'
import os, shutil, sys
pool, dest, mib = sys.argv[1:]
limit = int(mib) * 2**20 - 2**16  # room for the lists
wheels = sorted(os.listdir(f"{pool}/w"), key=lambda f: -os.path.getsize(f"{pool}/w/{f}"))
parts: list[list] = []
for w in wheels:
    size = os.path.getsize(f"{pool}/w/{w}")
    part = next((p for p in parts if p[0] + size <= limit), None)
    if part is None:
        part = [0]
        parts.append(part)
    part[0] += size
    part.append(w)
for i, (size, *files) in enumerate(parts, 1):
    d = f"{dest}/part{i}"
    os.makedirs(d)
    for f in files:
        shutil.move(f"{pool}/w/{f}", d)
    for lst in ("site_unsloth.txt", "site_trl.txt"):
        shutil.copy(f"{pool}/{lst}", d)
    print(f"{d}: {len(files)} wheels, {size / 2**20:.1f} MiB")
PY
du -sh "$dest" "$dest"/part*
