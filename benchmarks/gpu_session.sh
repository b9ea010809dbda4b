#!/usr/bin/env bash
# One device-machine call of issue 6's measurements: environment, smoke test, GPU tests, then sweeps until a
# deadline. Rows are appended (resumably) to data/measured/gpu-h100.csv and copied to $OUT.
#   bash benchmarks/gpu_session.sh SECONDS [smoke] [tests] [planner] [pool:--planner|pool:] SWEEP.yaml...
# pool: every gpu-*.yaml sweep side by side (benchmarks/gpu_pool.py), until SECONDS; pool:--planner adds the
# planner check pairs; 'pool:--workers 8 A.yaml B.yaml' pools only those sweeps (run first what matters most).
# diagnose:CASES.yaml: benchmarks/gpu_diagnose.py on those cases, tables into $OUT.
# wheels:DIR:SWEEP.yaml runs SWEEP through the pool with DIR's wheels (another transformers,
# say) in front of the rest, into its own data/measured/gpu-h100-DIR.csv (row keys do not hold package versions);
# quote a glob of sweeps: 'wheels:.whl-t448:benchmarks/sweeps/t448-*.yaml'. The wheel folders are not kept in a
# checkout: make them first with benchmarks/gpu_wheels.sh.
# alloctrace:MODEL:k=v,k=v records the caching allocator's own events of that setup (benchmarks/gpu_alloc_trace.py)
# into $OUT; compare them here with `python benchmarks/gpu_alloc_trace.py compare FILE`.
set -u
budget=$1; shift
end=$(( $(date +%s) + budget ))
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl; }
export PYTHONPATH=$PWD
for dir in .whl .whl-trl; do  # whichever folder the call carries
  if ls $dir/*.whl >/dev/null 2>&1; then
    install $dir /tmp/site || exit 1
    export PYTHONPATH=/tmp/site:$PWD
  fi
done
if [ -d /tmp/site/trl ] && ! python3 -c "import pandas" 2>/dev/null && ls .whl-trl/pandas/*.whl >/dev/null 2>&1; then
  install .whl-trl/pandas /tmp/site || exit 1  # trl/trainer/utils.py imports pandas at the top
fi
if [ -d /tmp/site/trl ] && ! python3 -c "import datasets" 2>/dev/null; then
  # trl/trainer/utils.py imports datasets.IterableDataset at the top; the fused LM head never touches a dataset
  mkdir -p /tmp/site/datasets && echo "class IterableDataset: pass" > /tmp/site/datasets/__init__.py
fi
if [ -d /tmp/site/trl ]; then  # say now, not row by row, when TRL's head cannot be imported here
  python3 -c "import trl.trainer.utils" || echo "TRL rows will fail: trl.trainer.utils does not import (see above)"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
csv=data/measured/gpu-h100.csv
save() { cp -f data/measured/*.csv "$OUTDIR"/ 2>/dev/null; }
( while sleep 30; do save; done ) >/dev/null 2>&1 &  # rows come back even when the call is stopped at its limit
saver=$!
trap 'kill $saver 2>/dev/null; save' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, transformers, peft, bitsandbytes, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__, 'bnb', bitsandbytes.__version__, 'accelerate', accelerate.__version__)
from importlib.metadata import version, PackageNotFoundError
for name in ('liger-kernel', 'torchao', 'schedulefree', 'triton'):
    try: print(name, version(name))
    except PackageNotFoundError: print(name, 'not installed')"
for step in "$@"; do
  left=$(( end - $(date +%s) ))
  [ "$left" -le 20 ] && { echo "deadline reached before $step"; break; }
  echo "=== $step ($left s left) $(date +%T)"
  case $step in
    smoke) timeout "$left" python3 -m memplan validate openai-community/gpt2 --precision bf16-mixed --batch-size 8 \
             --seq-len 512 --attn-impl sdpa --out "$csv" ;;
    tests) timeout "$left" python3 -m pytest -q -x -m gpu tests/ -p no:cacheprovider 2>&1 | tail -25 ;;
    planner) timeout "$left" python3 benchmarks/planner_check.py run ;;
    alloctrace:*) spec=${step#alloctrace:}; timeout "$left" python3 benchmarks/gpu_alloc_trace.py record "$OUTDIR" \
             "${spec%%:*}" $(echo "${spec#*:}" | tr , ' ') 2>&1 | tail -3 ;;
    diagnose:*) timeout "$left" python3 benchmarks/gpu_diagnose.py "$OUTDIR/diagnose-$(basename ${step#diagnose:} .yaml)" \
             "${step#diagnose:}" --parallel 3 2>&1 | tail -5 ;;
    pool:*) args=${step#pool:}; files=benchmarks/sweeps/gpu-*.yaml; case $args in *.yaml*) files=;; esac
             timeout $(( left + 200 )) python3 benchmarks/gpu_pool.py $(( left - 30 )) "$csv" $args $files 2>&1 \
               | grep -v Warning ;;
    wheels:*) spec=${step#wheels:}; dir=${spec%%:*}; name=$(basename "$dir" | tr -d .); site=/tmp/site-$name
             install "$dir" "$site" || continue
             PYTHONPATH=$site:$PYTHONPATH timeout $(( left + 200 )) python3 benchmarks/gpu_pool.py $(( left - 30 )) \
               "data/measured/gpu-h100-$name.csv" ${spec#*:} 2>&1 | grep -v Warning ;;  # unquoted: a glob of sweeps
    *.yaml) timeout "$left" python3 -m memplan validate --sweep "$step" --out "$csv" --timeout 300 2>&1 \
             | grep -v "^\s*$" | tail -60 ;;
  esac
  save
done
python3 - <<'PY'
import csv, glob
for f in sorted(glob.glob("data/measured/gpu-*.csv") + glob.glob("data/measured/planner-check*.csv")):
    rows = list(csv.DictReader(open(f)))
    print(f, len(rows), "rows;", {s: sum(r["status"] == s for r in rows) for s in ("ok", "oom", "error")})
    for r in rows:
        if r["status"] == "error":
            print("  ERROR", r["model"], r["technique"], r["precision"], r["error"][:300])
PY
