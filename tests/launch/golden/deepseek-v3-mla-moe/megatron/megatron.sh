#!/usr/bin/env bash
# stratagem export for Megatron-LM core_v0.19.0 (NVIDIA/Megatron-LM@5be9626709af), pretrain_gpt.py arguments (megatron/training/arguments.py)
# scenario: deepseek-v3 on 256x h100-sxm-80g
# plan: dp=8,tp=2,pp=16,ep=8,zero_stage=1,sequence_parallel=true,activation_checkpointing=full,first_stage_layers=1
# launch: 32 node(s) x 8 processes = world 256; 128 micro-batch(es) of 1 per step per data-parallel rank
# source: golden case deepseek-v3-mla-moe
# Not expressible in Megatron-LM core_v0.19.0 (left out):
#   - training.checkpoint.interval_minutes: Megatron counts --save-interval in iterations; no step time was given to convert it (export from a study, or pass an evaluation): add --save-interval
# Run on each of the 32 node(s) with MEGATRON_LM pointing at a Megatron-LM core_v0.19.0 checkout.
set -euo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
MASTER_PORT="${MASTER_PORT:-29500}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

MODEL_ARGS=(
  --num-layers 61
  --hidden-size 7168
  --ffn-hidden-size 18432
  --num-attention-heads 128
  --seq-length 4096
  --position-embedding-type rope
  --max-position-embeddings 4096
  --rotary-base 10000
  --rope-type yarn
  --rotary-scaling-factor 40
  --mscale 1
  --mscale-all-dim 1
  --swiglu
  --normalization RMSNorm
  --norm-epsilon 1e-06
  --untie-embeddings-and-output-weights
  --disable-bias-linear
  --num-experts 256
  --moe-router-topk 8
  --moe-ffn-hidden-size 2048
  --moe-grouped-gemm
  --moe-shared-expert-intermediate-size 2048
  --moe-layer-freq '([0]*3+[1]*58)'
  --moe-router-score-function sigmoid
  --moe-router-enable-expert-bias
  --multi-latent-attention
  --kv-lora-rank 512
  --qk-head-dim 128
  --qk-pos-emb-head-dim 64
  --v-head-dim 128
  --q-lora-rank 1536
  --mtp-num-layers 1
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --make-vocab-size-divisible-by 128
)
PARALLEL_ARGS=(
  --tensor-model-parallel-size 2
  --pipeline-model-parallel-size 16
  --context-parallel-size 1
  --sequence-parallel
  --expert-model-parallel-size 8
  --expert-tensor-parallel-size 1
  --decoder-first-pipeline-num-layers 1
  --use-distributed-optimizer
  --overlap-grad-reduce
  --overlap-param-gather
)
# --train-iters 50: 50 steps, a throughput check (10 warm-up + 40 timed steps; --steps N to change); the full run is 238419 steps (training_tokens 1e+12 / 4194304 tokens per step)
# --log-interval 1 --log-throughput: every iteration's time (ms) and TFLOP/s per GPU; leave out the first 10 (warm-up)
# No checkpoint is written inside this throughput check (no --save: Megatron saves at every --save-interval and after the
# last iteration). The full run adds to TRAINING_ARGS: --save "$CHECKPOINT_DIR" --async-save --use-persistent-ckpt-worker
TRAINING_ARGS=(
  --micro-batch-size 1
  --global-batch-size 1024
  --train-iters 50
  --log-interval 1
  --log-throughput
  --eval-iters 0
  --bf16
  --tp-comm-overlap
  --moe-token-dispatcher-type alltoall
  --recompute-granularity full
  --recompute-method uniform
  --recompute-num-layers 1
  --optimizer adam
  --ckpt-format torch_dist
)
# PLACEHOLDERS: synthetic data (--mock-data), no tokenizer (NullTokenizer) and a fixed learning
# rate, for a throughput check of this layout. To train, replace --mock-data with --data-path
# <your tokenized data prefix> and the tokenizer with e.g. --tokenizer-type HuggingFaceTokenizer
# --tokenizer-model <your tokenizer>, and set your learning-rate schedule.
DATA_ARGS=(
  --mock-data
  --tokenizer-type NullTokenizer
  --vocab-size 129280
  --lr 0.0001
)

torchrun --nnodes 32 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT \
  "$MEGATRON_LM/pretrain_gpt.py" "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}"
