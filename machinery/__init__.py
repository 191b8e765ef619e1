"""The run's machinery shared by the algorithm files: flags and logs, checkpoints, dumps, models and their
load-time checks, GGUF, LoRA, precision, torchrun, the prompt cache, scoring and errors. Nothing here is the
algorithm: grpo.py and ppo.py hold that."""
