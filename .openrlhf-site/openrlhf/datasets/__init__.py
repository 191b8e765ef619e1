from .prompts_dataset import PromptDataset
from .reward_dataset import RewardDataset
from .sft_dataset import SFTDataset

__all__ = ["PromptDataset", "RewardDataset", "SFTDataset"]
