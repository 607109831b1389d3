"""The packing constants the vLLM config and its methods share, below both: :mod:`.config` builds the
linear / embedding / MoE methods in vLLM's factory hook, and those methods read these (so they import
this module, never the config)."""

from __future__ import annotations

import math

from .. import _core

SUPPORTED_GROUP_SIZES = _core.GROUP_SIZES
# Codes are packed four per byte along K.
CODES_PER_BYTE = 4


def k_shard_multiple(group_size: int) -> int:
    """Smallest K a shard may hold: whole bytes of codes and whole scale groups."""
    return math.lcm(CODES_PER_BYTE, group_size)
