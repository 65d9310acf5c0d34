#!/usr/bin/env bash
# GRPO with LZE selection in verl 0.9.1's v1 trainer (trainer.use_v1=true, the default), on one
# node of 8 GPUs. Not run in this project's CI (no GPU); its selection path is what
# tests/test_verl_v1.py runs through verl's ReplayBuffer, TransferQueue and dataloader, and
# tests/test_verl_fit.py through verl's own fit() on the CPU (where the README's quick start,
# this script included, runs one step with the CPU harness's model and rollout).
#
#   pip install "verl[vllm]==0.9.1"
#   pip install -e .                          # from a clone of lze-kernels
#   python examples/verl/prepare_data.py      # GSM8K -> ~/data/gsm8k/{train,test}.parquet
#   bash examples/verl/run_lze_grpo.sh [extra hydra overrides]
#
# MODE=topk (the default, LZE as its paper runs it): each step rolls out train_batch_size (K)
# prompts and trains on the top k = floor(K x keep_ratio) groups by learning-zone energy, rounded
# to the nearest whole number of mini-batches (64 of 128 here, one mini-batch of 64; any
# ppo_mini_batch_size plain GRPO accepts works, lze/keep_ratio_effective logs the ratio kept,
# and v1 adds no padding rows). MODE=refill trains on K selected groups instead, rolling out
# ceil(K / keep_ratio) prompts and more (the extra ones through verl's refill, one prompt per
# fetch). FORWARD=greso (or pruner, dots) also chooses which prompts are rolled out at all; DOTS
# needs EMBEDDINGS, a torch file of [num_prompts, d] prompt embeddings in dataset order.
# METHOD=dapo keeps the groups whose rewards are not all equal instead of LZE's top k.
# LZERLHFDataset (data.custom_cls) keys each prompt by its row in the train set after the files
# are joined and filtered, and hands the buffer the train set's size (NUM_PROMPTS, if you set
# it, is checked against it). docs/verl.md has the account.
set -euo pipefail

TRAIN=${TRAIN:-$HOME/data/gsm8k/train.parquet}
VAL=${VAL:-$HOME/data/gsm8k/test.parquet}
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
NUM_PROMPTS=${NUM_PROMPTS:-}       # empty: the train set's rows, after filtering
BATCH=${BATCH:-128}
METHOD=${METHOD:-lze}              # lze | dapo (plain GRPO: verl without these overrides)
MODE=${MODE:-topk}                 # topk | refill
FORWARD=${FORWARD:-}               # empty | pruner | greso | dots
EMBEDDINGS=${EMBEDDINGS:-}

refill=()
[[ $MODE == refill ]] && refill=(data.gen_batch_size=1
                                 +trainer.v1.sampler.sampler_kwargs.gen_batch_size=1)
size=()
[[ -n $NUM_PROMPTS ]] && size=(+trainer.v1.sampler.sampler_kwargs.num_prompts="$NUM_PROMPTS")
forward=()
if [[ -n $FORWARD ]]; then
    forward=(+trainer.v1.sampler.sampler_kwargs.forward.method="$FORWARD"
             +trainer.v1.sampler.sampler_kwargs.forward.batch_size="$BATCH")
    [[ $FORWARD == dots ]] && forward+=(
        +trainer.v1.sampler.sampler_kwargs.forward.embeddings="$EMBEDDINGS")
fi

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$TRAIN" data.val_files="$VAL" \
    data.train_batch_size="$BATCH" \
    data.max_prompt_length=512 data.max_response_length=1024 \
    data.dataloader_num_workers=0 \
    data.custom_cls.path=pkg://lze_kernels.integrations.verl.checkpoint \
    data.custom_cls.name=LZERLHFDataset \
    trainer.v1.sampler.custom_sampler.path=pkg://lze_kernels.integrations.verl.replay_buffer \
    trainer.v1.sampler.custom_sampler.name=LZEReplayBuffer \
    +trainer.v1.sampler.sampler_kwargs.method="$METHOD" \
    "${size[@]}" \
    +trainer.v1.sampler.sampler_kwargs.mode="$MODE" \
    "${refill[@]}" \
    +trainer.v1.sampler.sampler_kwargs.lze.keep_ratio=0.5 \
    "${forward[@]}" \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    trainer.n_gpus_per_node=8 trainer.nnodes=1 \
    trainer.project_name=lze_verl trainer.experiment_name="grpo_${METHOD}_${MODE}${FORWARD:+_$FORWARD}" \
    trainer.save_freq=20 trainer.test_freq=10 trainer.total_epochs=3 \
    trainer.logger='["console"]' \
    "$@"
