#!/usr/bin/env bash
# stratagem export for torchrun + stratagem's harness (stratagem.launch.harness)
# scenario: mixtral-8x7b on 16x h100-sxm-80g
# plan: dp=8,tp=2,ep=8,zero_stage=3,sequence_parallel=true
# launch: 2 node(s) x 8 processes = world 16; 8 micro-batch(es) of 1 per step per data-parallel rank
# source: golden case mixtral-folding-ep8
# Approximated in the harness (closest setting; differs as said):
#   - model.rope_theta: mixtral-8x7b has rope_theta 1000000, norm eps 1e-05 (mistralai/Mixtral-8x7B-v0.1 config.json); the harness's model uses 500000 and 1e-05: the same step cost, other numerics
# Run this script on each of the 2 node(s); it writes result.json next to it.
set -euo pipefail
cd "$(dirname "$0")"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
MASTER_PORT="${MASTER_PORT:-29500}"
torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT -m stratagem.launch.harness --scenario scenario.yaml --plan dp=8,tp=2,pp=1,cp=1,ep=8,etp=1,dp_replicate=1,zero_stage=3,sequence_parallel=true,micro_batch_size=1,precision=bf16,activation_checkpointing=none,recompute_layers=0,recompute_modules=,pp_schedule=1f1b,virtual_stages=1,first_stage_layers=0,last_stage_layers=0,pp_split=layers,optimizer_offload=none --steps 20 --out result.json --seed 0
