#!/usr/bin/env bash
# seg-train installed the way users install it, used outside the repository:
#   build the wheel, install it with no extras into a fresh venv, check `--version`, and from an empty
#   folder train a copy of configs/demo.yaml for 3 steps on 2 towers (TensorBoard events written),
#   evaluate the result with seg-eval, export it to TFLite and check seg-eval --model's one-line error without
#   the tflite extra and its run with it, the same for ONNX (seg-export --format onnx's one-line error without
#   the onnx extra, the export and seg-eval --model with it), then remove TensorBoard and check the one-line error.
#
# Usage: scripts/check_wheel.sh [WHEELHOUSE]
#   WHEELHOUSE: a folder of wheels (from `pip download`) to install from instead of the package index,
#   so nothing is downloaded twice (.ci/run passes the one it fills). Environment: PYTHON (python3).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
PIP_OPTS=(-q)
if [[ $# -ge 1 ]]; then
    PIP_OPTS+=(--no-index --find-links "$(cd "$1" && pwd)")
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/seg-train-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
unset PYTHONPATH  # the installed package, not the checkout, must be what runs
start=$SECONDS
step() { printf '== %s (%ds)\n' "$*" $((SECONDS - start)); }

step "wheel"
# Built from a copy: a stale build/ folder in the checkout (setuptools' scratch space) can slip
# deleted modules into a wheel, and nothing that is not part of the source (venvs, data, runs) is copied.
mkdir "$WORK/src"
tar -C "$REPO" --exclude=./.git --exclude=./.venv --exclude=./build --exclude='*.egg-info' --exclude=./data \
    --exclude=./runs -cf - . | tar -C "$WORK/src" -xf -
"$PYTHON" -m venv "$WORK/venv"
BIN="$WORK/venv/bin"
"$BIN/python" -m pip wheel "${PIP_OPTS[@]}" --no-deps "$WORK/src" -w "$WORK/dist"
WHEEL=("$WORK"/dist/seg_train-*.whl)

step "install ${WHEEL[0]##*/} (no extras) into a fresh venv"
"$BIN/python" -m pip install "${PIP_OPTS[@]}" "${WHEEL[0]}"
if "$BIN/python" -c "import pytest" 2>/dev/null; then
    echo "check_wheel: pytest is installed without the test extra" >&2; exit 1
fi

mkdir "$WORK/empty"
cp "$REPO/configs/demo.yaml" "$WORK/empty/"
cd "$WORK/empty"
"$BIN/python" -c "import seg_train, sys
if '/site-packages/' not in seg_train.__file__:
    sys.exit('check_wheel: seg_train imported from ' + seg_train.__file__)"

step "seg-train --version"
"$BIN/seg-train" --version

step "seg-prepare --help (its converters import from the wheel)"
"$BIN/seg-prepare" --help >/dev/null

step "seg-train: 3 steps on 2 towers from an empty folder"
"$BIN/seg-train" --config demo.yaml --gpus 2 --set train.num_steps=3 --set train.summary_every=1 \
    --set train.image_summary_every=3 --set eval.bn_reestimate_batches=2
# The summaries are what a missing TensorBoard breaks: read them back with the installed TensorBoard
# (it starts TensorFlow, whose start-up noise is shown only if the check fails).
"$BIN/python" - 2>"$WORK/tags.err" <<'EOF' || { cat "$WORK/tags.err" >&2; exit 1; }
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator("runs/demo", size_guidance={"tensors": 0})
acc.Reload()
tags = set(acc.Tags()["tensors"])
need = {"loss/total", "loss/tower_0", "loss/tower_1", "learning_rate", "tower_0/image", "tower_1/prediction",
        "eval/miou"}
if need - tags:
    sys.exit(f"check_wheel: TensorBoard tags missing from runs/demo: {sorted(need - tags)}")
steps = [e.step for e in acc.Tensors("loss/total")]
if steps != [1, 2, 3]:
    sys.exit(f"check_wheel: loss/total written at steps {steps}, expected [1, 2, 3]")
print(f"TensorBoard events: {len(tags)} tags, loss/total at steps {steps}")
EOF

step "seg-eval"
"$BIN/seg-eval" --config demo.yaml --checkpoint runs/demo --gpus 2 --set eval.bn_reestimate_batches=2
test -s runs/demo/eval/val-step3.json

step "seg-export --format tflite (TensorFlow's converter: no extra needed)"
"$BIN/seg-export" --config demo.yaml --checkpoint runs/demo --format tflite --quantize int8 \
    --calibration-images 8 --output demo_int8.tflite --set eval.bn_reestimate_batches=2
test -s demo_int8.tflite && test -s demo_int8.json
step "seg-eval --model without the tflite extra: one line"
set +e
"$BIN/seg-eval" --config demo.yaml --model demo_int8.tflite 2>err.txt
code=$?
set -e
cat err.txt
if [[ $code != 2 || $(wc -l <err.txt) != 1 ]] || ! grep -q "^error: ai-edge-litert is not installed" err.txt; then
    echo "check_wheel: expected exit 2 and one 'error: ai-edge-litert is not installed' line, got exit $code" >&2
    exit 1
fi
step "the tflite extra installed: seg-eval --model runs the file in LiteRT"
"$BIN/python" -m pip install "${PIP_OPTS[@]}" "${WHEEL[0]}[tflite]"
"$BIN/seg-eval" --config demo.yaml --model demo_int8.tflite --json | tail -n 1 >record.json
"$BIN/python" -c "import json; r = json.load(open('record.json')); assert r['format'] == 'tflite' and r['miou'] > 0, r"
step "seg-export --format onnx without the onnx extra: one line"
set +e
"$BIN/seg-export" --config demo.yaml --checkpoint runs/demo --format onnx --output demo.onnx 2>err.txt
code=$?
set -e
cat err.txt
if [[ $code != 2 || $(wc -l <err.txt) != 1 ]] || ! grep -q "^error: tf2onnx is not installed" err.txt \
        || [[ -e demo.onnx ]]; then
    echo "check_wheel: expected exit 2 and one 'error: tf2onnx is not installed' line, got exit $code" >&2
    exit 1
fi
step "the onnx extra installed: seg-export --format onnx, seg-eval --model runs the file in ONNX Runtime"
"$BIN/python" -m pip install "${PIP_OPTS[@]}" "${WHEEL[0]}[onnx]"
"$BIN/python" -m pip check
"$BIN/seg-export" --config demo.yaml --checkpoint runs/demo --format onnx --output demo.onnx \
    --set eval.bn_reestimate_batches=2
test -s demo.onnx && test -s demo.json
"$BIN/seg-eval" --config demo.yaml --model demo.onnx --json | tail -n 1 >record.json
"$BIN/python" -c "import json; r = json.load(open('record.json')); assert r['format'] == 'onnx' and r['miou'] > 0, r"
step "TensorBoard removed: one line before any work"
"$BIN/python" -m pip uninstall -q -y tensorboard
set +e
"$BIN/seg-train" --config demo.yaml --gpus 2 --run-dir run-without-tensorboard 2>err.txt
code=$?
set -e
cat err.txt
if [[ $code != 2 || $(wc -l <err.txt) != 1 ]] || ! grep -q "^error: TensorBoard is not installed" err.txt \
        || [[ -e run-without-tensorboard ]]; then
    echo "check_wheel: expected exit 2 and one 'error: TensorBoard is not installed' line, got exit $code" >&2
    exit 1
fi
step "wheel check passed"
