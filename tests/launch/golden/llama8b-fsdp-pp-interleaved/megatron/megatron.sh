#!/usr/bin/env bash
# stratagem export for Megatron-LM core_v0.19.0 (NVIDIA/Megatron-LM@5be9626709af), pretrain_gpt.py arguments (megatron/training/arguments.py)
# scenario: llama3-8b on 16x h100-sxm-80g
# plan: dp=4,pp=4,zero_stage=3,micro_batch_size=2,activation_checkpointing=full,pp_schedule=interleaved,virtual_stages=2
# launch: 2 node(s) x 8 processes = world 16; 8 micro-batch(es) of 2 per step per data-parallel rank
# source: golden case llama8b-fsdp-pp-interleaved
# Not expressible in Megatron-LM core_v0.19.0 (left out):
#   - training.checkpoint.interval_minutes: Megatron counts --save-interval in iterations; no step time was given to convert it (export from a study, or pass an evaluation): add --save-interval
#   - training.checkpoint.mode: async: Megatron's --async-save is wired for --ckpt-format torch_dist; Megatron-FSDP needs fsdp_dtensor, so checkpoints are saved synchronously
# Run on each of the 2 node(s) with MEGATRON_LM pointing at a Megatron-LM core_v0.19.0 checkout.
set -euo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
MASTER_PORT="${MASTER_PORT:-29500}"
unset CUDA_DEVICE_MAX_CONNECTIONS

MODEL_ARGS=(
  --num-layers 32
  --hidden-size 4096
  --ffn-hidden-size 14336
  --num-attention-heads 32
  --group-query-attention
  --num-query-groups 8
  --seq-length 8192
  --position-embedding-type rope
  --max-position-embeddings 8192
  --rotary-base 500000
  --swiglu
  --normalization RMSNorm
  --norm-epsilon 1e-05
  --untie-embeddings-and-output-weights
  --disable-bias-linear
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --make-vocab-size-divisible-by 128
)
PARALLEL_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 4
  --context-parallel-size 1
  --num-layers-per-virtual-pipeline-stage 4
  --use-megatron-fsdp
  --data-parallel-sharding-strategy optim_grads_params
  --overlap-grad-reduce
  --overlap-param-gather
)
# --train-iters 50: 50 steps, a throughput check (10 warm-up + 40 timed steps; --steps N to change); the full run is 1907349 steps (training_tokens 1e+12 / 524288 tokens per step)
# --log-interval 1 --log-throughput: every iteration's time (ms) and TFLOP/s per GPU; leave out the first 10 (warm-up)
# No checkpoint is written inside this throughput check (no --save: Megatron saves at every --save-interval and after the
# last iteration). The full run adds to TRAINING_ARGS: --save "$CHECKPOINT_DIR"
TRAINING_ARGS=(
  --micro-batch-size 2
  --global-batch-size 64
  --train-iters 50
  --log-interval 1
  --log-throughput
  --eval-iters 0
  --bf16
  --recompute-granularity full
  --recompute-method uniform
  --recompute-num-layers 1
  --optimizer adam
  --ckpt-format fsdp_dtensor
)
# PLACEHOLDERS: synthetic data (--mock-data), no tokenizer (NullTokenizer) and a fixed learning
# rate, for a throughput check of this layout. To train, replace --mock-data with --data-path
# <your tokenized data prefix> and the tokenizer with e.g. --tokenizer-type HuggingFaceTokenizer
# --tokenizer-model <your tokenizer>, and set your learning-rate schedule.
DATA_ARGS=(
  --mock-data
  --tokenizer-type NullTokenizer
  --vocab-size 128256
  --lr 0.0001
)

torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT \
  "$MEGATRON_LM/pretrain_gpt.py" "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}"
