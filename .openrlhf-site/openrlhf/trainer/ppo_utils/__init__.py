from .experience import Experience, balance_experiences, make_experience_batch, split_experience_batch
from .kl_controller import AdaptiveKLController, FixedKLController
from .length_penalty import apply_length_penalties, apply_overlong_penalty, apply_stop_properly_penalty
from .replay_buffer import NaiveReplayBuffer

__all__ = [
    "AdaptiveKLController",
    "Experience",
    "FixedKLController",
    "NaiveReplayBuffer",
    "apply_length_penalties",
    "apply_overlong_penalty",
    "apply_stop_properly_penalty",
    "balance_experiences",
    "make_experience_batch",
    "split_experience_batch",
]
