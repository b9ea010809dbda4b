#!/usr/bin/env bash
# Fetch (here, where PyPI answers) the wheels issue 6's device calls carry, into git-ignored folders:
#   .whl        bitsandbytes 0.50.2 and pydantic with its own needs (the device image has neither; peft, accelerate,
#               transformers 5.17 are there), plus the .whl-2026 wheels, so that one folder travels
#   .whl-t523   transformers 5.23.0 (T5's per-layer sdpa position-bias masks: benchmarks/sweeps/t5-transformers523.yaml)
#   .whl-t524   transformers 5.24.0, the release memplan's venv and CI run (issue 43 item 8: the planner pairs and 30
#               earlier rows again, benchmarks/sweeps/t524-recheck.yaml; 5.23 imported on the image with its own
#               huggingface-hub, tokenizers and safetensors, and 5.24 asks the same versions of them)
#   .whl-t448   transformers 4.48.1, peft 0.13.2 and their pins (older code paths: benchmarks/sweeps/t448-*.yaml)
#   .whl-trl    trl 1.16.0 and pydantic's set, without bitsandbytes: issue 38's TRL sweep (benchmarks/sweeps/
#               gpu-2026-trl.yaml) carried alone, [".whl-trl"]; gpu_session.sh stubs the `datasets` import trl's
#               trainer utilities make (pyarrow alone is 55 MB; nothing on the memory path reads a dataset)
#   .whl-2026   liger-kernel, torchao, schedulefree, galore-torch and apollo-torch (issue 39's techniques:
#               benchmarks/sweeps/gpu-2026-techniques.yaml;
#               liger-kernel needs triton, which the device image's torch brings)
# A checkout does not keep ignored folders between sessions; run this first in a session with a GPU (about a
# minute), then: carry [".whl", ".whl-t523"] (about 30 MiB of the 64 MiB a call may carry) and so on.
# Session 33 (H200, 2026-11-27) measured 176 rows in two calls of the whole 2026 pool with [".whl"] alone:
#   bash benchmarks/gpu_session.sh 470 'pool:--planner --workers 12 benchmarks/sweeps/gpu-2026-*.yaml'  (then 250)
# Session 36 (H200, 2026-11-27) ran the call below in two parts (480 s, then 230 s): the alloctrace, the planner
# pairs, 125 + 52 pool rows, 107 of them again (adding Setup.group_size had changed every row key: fixed since,
# rows.LATER_FIELDS); the FP8 rows failed at random init (float8 has no normal_ kernel: fixed since).
# What is left (issue 43), one call, carry [".whl", ".whl-t523"] (about 30 MiB), timeout_s 600: the allocator's own
# traces of the two planner rows where the replay and the capped GPU disagree and of a gpt2 row that reserves one
# fp32 [tokens, vocab] block more than the replay (gpu_alloc_trace.py), 10 rows of the
# 2026 pool (DPO over bitsandbytes, three offloading rows, torchao int4/int8 and FP8), the planner batches the closed form
# plans since the split-cache term (DPO LoRA 23, GRPO 132 and 64, their next and bound), then LoRA on FP8 under
# transformers 5.23 (FP8LinearFunction came in 5.22; the image has 5.17):
#   bash benchmarks/gpu_session.sh 500 \
#     'alloctrace:Qwen/Qwen2.5-1.5B:technique=qlora,precision=bf16,quant=nf4,double_quant=true,lora_r=16,lora_alpha=32,lora_targets=all-linear,batch_size=4,seq_len=1024,grad_ckpt=true,attn_impl=sdpa,padded=true,cap=12335906816' \
#     'alloctrace:openai-community/gpt2:precision=bf16,optimizer=adafactor,attn_impl=sdpa' \
#     'alloctrace:Qwen/Qwen2.5-0.5B:trainer=dpo,technique=lora,precision=bf16-mixed,lora_r=16,lora_alpha=32,lora_targets=all-linear,batch_size=24,seq_len=1024,grad_ckpt=true,attn_impl=sdpa,padded=true,cap=12335906816' \
#     'pool:--planner --workers 12 benchmarks/sweeps/gpu-2026-trl.yaml benchmarks/sweeps/gpu-2026-techniques.yaml
#      benchmarks/sweeps/gpu-2026-torchao.yaml' \
#     'wheels:.whl-t523:benchmarks/sweeps/gpu-2026-fp8-lora.yaml'
# Then (issue 43 item 8, last in priority), a second call, carry [".whl", ".whl-t524"], timeout_s 400: the planner
# pairs planned under 5.24 (their rows into data/measured/planner-check-t5.24.0.csv) and 30 earlier rows again:
#   bash benchmarks/gpu_session.sh 330 'wheels:.whl-t524:--planner benchmarks/sweeps/t524-recheck.yaml'
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qsx '/.whl*/' .git/info/exclude || { mkdir -p .git/info; echo '/.whl*/' >> .git/info/exclude; }
get() {  # DIR SPEC...: Python 3.12 manylinux wheels for the device image, none of their dependencies
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dir" "$@"
}
get .whl bitsandbytes==0.50.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0
get .whl-t523 transformers==5.23.0
get .whl-t524 transformers==5.24.0
get .whl-t448 transformers==4.48.1 peft==0.13.2 tokenizers==0.21.4 huggingface_hub==0.36.2
get .whl-2026 liger-kernel==0.8.2 torchao==0.18.0 schedulefree==1.4.1 galore-torch==1.0 apollo-torch==1.0.3
get .whl-trl trl==1.16.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0
# trl's trainer utilities import pandas at the top; gpu_session.sh installs these only where the image lacks it
get .whl-trl/pandas pandas==2.3.3 python-dateutil==2.9.0.post0 pytz==2025.2 tzdata==2025.2 six==1.17.0
# bitsandbytes' native libraries for CUDA 13 only (the device image's torch is cu130): 43 MB -> 3 MB
python3 benchmarks/slim_wheel.py .whl/bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl 13
cp .whl-2026/*.whl .whl-trl/trl-*.whl .whl/  # 15 MiB: one call carries [".whl"] for every 2026 sweep, TRL's too
du -sh .whl .whl-t523 .whl-t524 .whl-t448 .whl-2026 .whl-trl
