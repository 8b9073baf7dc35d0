"""Small models to train here in minutes, single-device and free of parallel code.

``plait.parallel.apply_tp`` makes them parallel.
"""

from .dlrm import DLRM, DLRMConfig, EmbeddingBagCollection
from .gpt import GPT, GPTConfig, moe_gpt_config
from .moe import MoEFeedForward

__all__ = ["GPT", "GPTConfig", "DLRM", "DLRMConfig", "EmbeddingBagCollection",
           "MoEFeedForward", "moe_gpt_config"]
