# No implicit imports of deepspeed here to avoid vllm environment gets comtaminated
from .vllm_engine import batch_vllm_engine_call, create_vllm_engines

__all__ = [
    "create_vllm_engines",
    "batch_vllm_engine_call",
]
