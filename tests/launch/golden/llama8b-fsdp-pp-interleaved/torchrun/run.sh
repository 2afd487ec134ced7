#!/usr/bin/env bash
# stratagem export for torchrun + stratagem's harness (stratagem.launch.harness)
# scenario: llama3-8b on 16x h100-sxm-80g
# plan: dp=4,pp=4,zero_stage=3,micro_batch_size=2,activation_checkpointing=full,pp_schedule=interleaved,virtual_stages=2
# launch: 2 node(s) x 8 processes = world 16; 8 micro-batch(es) of 2 per step per data-parallel rank
# source: golden case llama8b-fsdp-pp-interleaved
# Every plan field is expressed exactly in the harness.
# Run this script on each of the 2 node(s); it writes result.json next to it.
set -euo pipefail
cd "$(dirname "$0")"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
MASTER_PORT="${MASTER_PORT:-29500}"
torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT -m stratagem.launch.harness --scenario scenario.yaml --plan dp=4,tp=1,pp=4,cp=1,ep=1,etp=1,dp_replicate=1,zero_stage=3,sequence_parallel=false,micro_batch_size=2,precision=bf16,activation_checkpointing=full,recompute_layers=0,recompute_modules=,pp_schedule=interleaved,virtual_stages=2,first_stage_layers=0,last_stage_layers=0,pp_split=layers,optimizer_offload=none --steps 20 --out result.json --seed 0
