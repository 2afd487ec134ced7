#!/usr/bin/env bash
# stratagem export for torchrun + stratagem's harness (stratagem.launch.harness)
# scenario: tiny on 4x cpu
# plan: dp=2,tp=2
# launch: 1 node(s) x 4 processes = world 4; 4 micro-batch(es) of 1 per step per data-parallel rank
# source: golden case tiny-tp2
# Every plan field is expressed exactly in the harness.
# Run this script on each of the 1 node(s); it writes result.json next to it.
set -euo pipefail
cd "$(dirname "$0")"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
torchrun --nnodes 1 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT -m stratagem.launch.harness --scenario scenario.yaml --plan dp=2,tp=2,pp=1,cp=1,ep=1,etp=1,dp_replicate=1,zero_stage=0,sequence_parallel=false,micro_batch_size=1,precision=bf16,activation_checkpointing=none,recompute_layers=0,recompute_modules=,pp_schedule=1f1b,virtual_stages=1,first_stage_layers=0,last_stage_layers=0,pp_split=layers,optimizer_offload=none --steps 20 --out result.json --seed 0
