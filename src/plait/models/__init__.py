"""Small models to train here in minutes, single-device and free of parallel code.

``plait.nn.parallelize.apply_tp`` makes them parallel.
"""

from .dlrm import DLRM, DLRMConfig, EmbeddingBagCollection
from .gpt import GPT, GPTConfig
from .moe import MoEFeedForward, moe_gpt_config

__all__ = ["GPT", "GPTConfig", "DLRM", "DLRMConfig", "EmbeddingBagCollection",
           "MoEFeedForward", "moe_gpt_config"]
