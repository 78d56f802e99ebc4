#!/usr/bin/env bash
# Gathers into one git-ignored folder (.gpu_carry/) what the lent GPU machine lacks for benchmarks/bench_gpu.py, checks
# that the working tree plus the folder stay within the 64 MiB a run may carry, and prints the one command to run there.
#
# That machine (docs: /work/.library/device/) has Python 3.12 on x86-64 with torch, accelerate, transformers, safetensors
# and numpy, and no network. It lacks diffusers, gguf, comfy-aimdo, comfy-kitchen (whose 170 MB CUDA extension is left
# out: ComfyUI falls back to its eager and triton kernels) and ComfyUI itself. What this gathers:
#   .gpu_carry/wheels/        wheels for Python 3.12 / manylinux x86-64 (pip download --only-binary, --no-deps), installed
#                             there with pip install --no-index --target /tmp/site
#   .gpu_carry/site/          comfy_kitchen's Python files (from its cp312 wheel, without the compiled extensions)
#   .gpu_carry/ComfyUI/       a ComfyUI checkout without its frontend, tests, workflows blueprints and tokenizer data
#   .gpu_carry/ComfyUI-GGUF/  city96's pack: its .py files
#
#   benchmarks/gpu_carry.sh                    # uses $COMFYUI_033_PATH (or COMFYUI_SRC) and $GGUF_PACK
#   COMFYUI_SRC=~/ComfyUI GGUF_PACK=~/ComfyUI-GGUF benchmarks/gpu_carry.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CARRY=.gpu_carry
DEST="$ROOT/$CARRY"
COMFY=${COMFYUI_SRC:-${COMFYUI_033_PATH:-/work/envs/ComfyUI-0.33.0}}
GGUF=${GGUF_PACK:-/work/envs/ComfyUI-GGUF}
PY=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))
DIFFUSERS=${DIFFUSERS_VERSION:-0.42.1}
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64
          --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

say() { echo "[gpu_carry] $*" >&2; }

[ -f "$COMFY/comfy/model_management.py" ] || { say "no ComfyUI checkout at $COMFY (set COMFYUI_SRC)"; exit 2; }
# the versions ComfyUI asks for, so its DynamicVRAM and kernels match the checkout
want() { grep -i -E "^$1[=<>~ ]" "$COMFY/requirements.txt" | head -1 | tr -d ' ' || true; }
AIMDO=$(want comfy-aimdo); AIMDO=${AIMDO:-comfy-aimdo}
KITCHEN=$(want comfy-kitchen); KITCHEN=${KITCHEN:-comfy-kitchen}

rm -rf "$DEST"
mkdir -p "$DEST/wheels" "$DEST/site" "$DEST/ComfyUI" "$DEST/ComfyUI-GGUF"
grep -qxF "/$CARRY/" "$ROOT/.gitignore" 2>/dev/null || say "note: add /$CARRY/ to .gitignore (it must not travel as tracked files)"

say "wheels for Python 3.12 / x86-64: diffusers==$DIFFUSERS gguf importlib_metadata $AIMDO"
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DEST/wheels" \
    "diffusers==$DIFFUSERS" "gguf" "importlib_metadata" "$AIMDO" 2>&1 | grep -v -E "^WARNING: Location" || true

say "$KITCHEN: its Python files only (the compiled CUDA/HIP extensions stay behind)"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$TMP" "$KITCHEN" 2>&1 | grep -v -E "^WARNING: Location" || true
"$PY" - "$TMP" "$DEST/site" <<'EOF'
import sys, zipfile, pathlib
src, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for whl in src.glob("comfy_kitchen-*.whl"):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if name.endswith((".so", ".pyd", ".dll")) or "/__pycache__/" in name:
                continue
            z.extract(name, dest)
EOF

say "ComfyUI from $COMFY (no frontend, tests, blueprints or tokenizer data)"
(cd "$COMFY" && find . -type f \
    -not -path "./.git/*" -not -path "./tests/*" -not -path "./tests-unit/*" -not -path "./.github/*" \
    -not -path "./.ci/*" -not -path "./blueprints/*" -not -path "./comfy_api_nodes/*" -not -path "./script_examples/*" \
    -not -path "./output/*" -not -path "./input/*" -not -path "./temp/*" -not -path "./user/*" \
    -not -path "./custom_nodes/*" -not -path "./models/*" -not -path "*/__pycache__/*" \
    -not \( -path "*tokenizer*/*" -not -name "*.py" \) -not -name "*.pyc" -print0) \
  | (cd "$COMFY" && tar --null -T - -cf -) | tar -xf - -C "$DEST/ComfyUI"
mkdir -p "$DEST/ComfyUI/models" "$DEST/ComfyUI/custom_nodes"

say "ComfyUI-GGUF from $GGUF"
if [ -f "$GGUF/ops.py" ]; then
  cp "$GGUF"/*.py "$DEST/ComfyUI-GGUF/"
  [ -f "$GGUF/LICENSE" ] && cp "$GGUF/LICENSE" "$DEST/ComfyUI-GGUF/"
else
  say "no ComfyUI-GGUF at $GGUF: the GGUF rows will be skipped with that reason"
  rmdir "$DEST/ComfyUI-GGUF"
fi

# what travels: tracked files, untracked files git does not ignore, and the carried folder
tree=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
carry=$(du -sb "$DEST" | cut -f1)
total=$((tree + carry))
say "$(ls "$DEST/wheels" | tr '\n' ' ')"
printf '[gpu_carry] working tree %.1f MiB + %s %.1f MiB = %.1f MiB of %d MiB\n' \
    "$(echo "$tree / 1048576" | bc -l)" "$CARRY" "$(echo "$carry / 1048576" | bc -l)" \
    "$(echo "$total / 1048576" | bc -l)" $((LIMIT / 1048576)) >&2
if [ "$total" -gt "$LIMIT" ]; then
  say "ERROR: over the 64 MiB a run may carry; leave something out"
  exit 1
fi

cat <<EOF
Run on the lent GPU machine (device tool: run), in one call:
  carry:     ["$CARRY"]
  timeout_s: 590
  command:   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $CARRY/wheels/*.whl && export PYTHONPATH=/tmp/site:\$PWD/$CARRY/site PYTHONUNBUFFERED=1 && python3 benchmarks/bench_gpu.py --comfyui $CARRY/ComfyUI --gguf-pack $CARRY/ComfyUI-GGUF --out \$OUT 2>&1 | tee \$OUT/log.txt
EOF
