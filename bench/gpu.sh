#!/usr/bin/env bash
# The GPU checks of `dedloc train` (issue 17), as one script of at most ~6 minutes on one GPU:
# the AMP test on CUDA (fp16 with a collaboration-wide GradScaler), then ALBERT-large (the
# albert-mlm recipe) samples/s on this GPU: plain single-process training against `dedloc train`
# with one peer, same data pipeline and micro-batches. Prints JSON lines.
#   bash bench/gpu.sh            (after the README's test set-up, with a CUDA build of torch)
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import json, torch; print(json.dumps({'cuda': torch.cuda.is_available(), 'device': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, 'torch': torch.__version__}))"
timeout 120 python -m pytest -q -p no:cacheprovider "tests/test_amp.py::test_overflow_on_one_peer_skips_the_step_on_all[cuda]" \
  | tail -1 | python -c "import json, sys; line = sys.stdin.read().strip(); print(json.dumps({'amp_cuda_test': line}))"
timeout 240 python bench/train.py --recipe albert-mlm --device cuda --steps 4 --micro-batch 32 \
  --target-batch-size 512 --data-workers 4 --corpus-files 1500 --pipeline-seconds 5
