"""Checks of a ternary checkpoint's files before vLLM loads any weight, and after, where invalid values are.

vLLM trusts a checkpoint: a ``scales`` tensor of the wrong shape fails deep in its weight loader (an
assertion naming neither file nor tensor), one of the wrong dtype is silently cast, a missing ``qweight``
or ``scales`` leaves uninitialised memory in the layer (served as garbage, quantized models skip vLLM's
"weights not initialized" check), and a truncated shard fails inside safetensors. So
:meth:`TernaryConfig.maybe_update_config <ternary_rs.vllm.config.TernaryConfig.maybe_update_config>`
reads every shard header of a local checkpoint with ternary_rs's reader (offsets and sizes validated
against the file) and :func:`check_ternary_tensors` refuses, naming the file and tensor:

* a shard whose header or data is cut short (or otherwise malformed);
* ``<p>.qweight`` that is not ``uint8 [N, K/4]``, or has no ``<p>.scales``;
* ``<p>.scales`` that is not ``float16 [N, K/g]`` (``g`` = ``group_size`` of ``config.json``), or has no
  ``<p>.qweight``.

Tensor *values* (code 3, NaN/Inf scales) are checked after loading, where they are in memory anyway
(``linear.validate_loaded``); when that fails, :func:`locate_invalid` reads the layer's checkpoint tensors
again to name the file, tensor and first bad index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CONFIG_FILE = "config.json"
# Problems listed in one error (the rest are counted).
MAX_LISTED = 8


@dataclass
class CheckpointTensors:
    """The tensors of a local checkpoint, from its headers: name -> (shard file, dtype, shape)."""

    directory: Path
    tensors: dict[str, tuple[str, str, tuple[int, ...]]] = field(default_factory=dict)

    def file_of(self, name: str) -> str | None:
        hit = self.tensors.get(name)
        return hit[0] if hit else None


def read_checkpoint(model: str) -> CheckpointTensors | None:
    """Headers of every safetensors shard of a local checkpoint directory (None for a remote model).

    Raises ``ValueError`` naming the shard (and tensor) when a header is malformed or a tensor's bytes
    run past the end of its file (a truncated shard).
    """
    from .._core import FormatError, TernaryError
    from ..sources.reader import open as open_checkpoint

    directory = Path(model)
    if not directory.is_dir():
        return None
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    sources = indexes[:1] if indexes else sorted(directory.glob("*.safetensors"))
    ckpt = CheckpointTensors(directory)
    for src in sources:
        try:
            with open_checkpoint(src) as f:
                for name, info in f.tensors.items():
                    ckpt.tensors[name] = (str(info.file), str(info.type), tuple(int(d) for d in info.shape))
        except (FormatError, TernaryError) as e:
            raise ValueError(f"ternary checkpoint {directory}: cannot be loaded: {e}") from None
    return ckpt


def check_ternary_tensors(ckpt: CheckpointTensors, group_size: int) -> None:
    """Refuse qweight/scales pairs that are missing a half or have the wrong dtype or shape."""
    problems: list[str] = []
    tensors = ckpt.tensors
    where = f"(group_size = {group_size} from {ckpt.directory / CONFIG_FILE})"
    for name, (file, dtype, shape) in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            scales = tensors.get(prefix + ".scales")
            if dtype != "U8" or len(shape) != 2 or shape[1] == 0:
                problems.append(f"{file}: tensor '{name}' is {dtype} {list(shape)}; a ternary qweight is "
                                f"U8 [N, K/4] (four 2-bit codes per byte)")
                continue
            if scales is None:
                problems.append(f"{file}: tensor '{name}' has no '{prefix}.scales' in the checkpoint "
                                f"(missing scales tensor)")
                continue
            s_file, s_dtype, s_shape = scales
            n, k = shape[0], shape[1] * 4
            want = [n, k // group_size] if k % group_size == 0 else None
            if s_dtype != "F16":
                problems.append(f"{s_file}: tensor '{prefix}.scales' is {s_dtype}; ternary scales are F16")
            elif want is None:
                problems.append(f"{file}: tensor '{name}' has K = {k}, not a multiple of the group size {where}")
            elif list(s_shape) != want:
                problems.append(f"{s_file}: tensor '{prefix}.scales' has shape {list(s_shape)}, expected {want} "
                                f"= [N, K/g] for '{name}' {list(shape)} {where}")
        elif name.endswith(".scales"):
            prefix = name[: -len(".scales")]
            if prefix + ".qweight" not in tensors:
                problems.append(f"{file}: tensor '{name}' has no '{prefix}.qweight' in the checkpoint "
                                f"(missing qweight tensor)")
    if problems:
        more = f"\n  … and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise ValueError(f"ternary checkpoint {ckpt.directory} is malformed:\n  "
                         + "\n  ".join(problems[:MAX_LISTED]) + more)


def locate_invalid(ckpt: CheckpointTensors | None, names: dict[str, str], parts: list[str]) -> str:
    """Where the invalid values of a layer made of checkpoint prefixes ``parts`` are: one
    ``FILE: tensor 'NAME': code 3 / NaN/Inf at [row, col], COUNT values`` per bad tensor.

    ``names`` maps a (vLLM-mapped) tensor name to its checkpoint name. Reads only these tensors.
    """
    from .._core import TernaryError
    from ..sources.reader import open as open_checkpoint

    if ckpt is None:
        return "the checkpoint is not a local directory, so the tensor could not be located"
    found = []
    for part in parts:
        for suffix in (".qweight", ".scales"):
            name = names.get(part + suffix, part + suffix)
            file = ckpt.file_of(name)
            if file is None:
                continue
            try:
                with open_checkpoint(file) as f:
                    raw = np.asarray(f.raw(name))
            except (TernaryError, OSError) as e:
                found.append(f"{file}: tensor '{name}' could not be read again: {e}")
                continue
            shape = ckpt.tensors[name][2]
            if suffix == ".qweight":
                bad, what = (raw & (raw >> 1) & 0x55) != 0, "the invalid code 3"
            else:
                bad, what = ~np.isfinite(raw.view(np.float16)), "NaN/Inf"
            if bad.any():
                row, col = np.unravel_index(int(np.flatnonzero(bad)[0]), shape)
                found.append(f"{file}: tensor '{name}' holds {what} (first at [{row}, {col}], "
                             f"{int(bad.sum())} {'bytes' if suffix == '.qweight' else 'values'})")
    return "; ".join(found) if found else "the checkpoint tensors of this layer hold no invalid values on disk"
