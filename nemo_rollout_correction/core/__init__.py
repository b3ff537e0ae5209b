"""Pure-torch rollout-correction math: no torch.distributed, megatron, vllm, omegaconf, hydra or mlflow."""
