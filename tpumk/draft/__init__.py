"""Hidden-state drafters for speculative decoding (issue 56): drafters that read the target's own
hidden states (taps) and propose a block of tokens the megakernel verifies in one step.

The `speculators` 0.9.0 format (config.json + safetensors; tpumk.draft.config) for `eagle3`,
`mtp`, `dflash`, `dflash2` and `dspark`, and a DeepSeek-V3-style checkpoint's own next-token
layer (`load_drafter("mtp", target_cfg, checkpoint=DIR)`); each kind's forward, `absorb` and
`propose` in pure JAX (tpumk.draft.chain: eagle3, mtp; tpumk.draft.block: the dflash family),
built from tpumk.model.reference's pieces. docs/speculative.md describes them.
"""

from tpumk.draft.config import BLOCK_KINDS, CHAIN_KINDS, KINDS, DrafterSpec
from tpumk.draft.drafter import Drafter, load_drafter, random_drafter

__all__ = ["KINDS", "CHAIN_KINDS", "BLOCK_KINDS", "Drafter", "DrafterSpec", "load_drafter", "random_drafter"]
