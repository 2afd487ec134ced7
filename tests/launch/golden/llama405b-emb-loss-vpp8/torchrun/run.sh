#!/usr/bin/env bash
# stratagem export for torchrun + stratagem's harness (stratagem.launch.harness)
# scenario: llama3-405b on 128x h100-sxm-80g
# plan: tp=8,pp=16,sequence_parallel=true,activation_checkpointing=full,pp_schedule=interleaved,virtual_stages=8,pp_split=embedding_loss
# launch: 16 node(s) x 8 processes = world 128; 64 micro-batch(es) of 1 per step per data-parallel rank
# source: golden case llama405b-emb-loss-vpp8
# Approximated in the harness (closest setting; differs as said):
#   - model.rope_scaling: llama3-405b has rope_scaling llama3 (factor 8, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192) (meta-llama/Llama-3.1-405B config.json); the harness's rotary embedding has none: the same step cost, other numerics
# Run this script on each of the 16 node(s); it writes result.json next to it.
set -euo pipefail
cd "$(dirname "$0")"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
MASTER_PORT="${MASTER_PORT:-29500}"
torchrun --nnodes 16 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT -m stratagem.launch.harness --scenario scenario.yaml --plan dp=1,tp=8,pp=16,cp=1,ep=1,etp=1,dp_replicate=1,zero_stage=0,sequence_parallel=true,micro_batch_size=1,precision=bf16,activation_checkpointing=full,recompute_layers=0,recompute_modules=,pp_schedule=interleaved,virtual_stages=8,first_stage_layers=0,last_stage_layers=0,pp_split=embedding_loss,optimizer_offload=none --steps 20 --out result.json --seed 0
