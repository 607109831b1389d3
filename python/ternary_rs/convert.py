"""``ternary-rs convert`` and friends: any ternary checkpoint -> vLLM directory or ternary GGUF.

Flow for one source (``convert``):

1. ``ternary_rs.open`` maps the source (GGUF, safetensors file, sharded index or HF directory) —
   headers only.
2. The architecture (``ternary_rs.arch``) gives Hugging Face <-> llama.cpp names and layout permutations.
3. Every tensor is classified: *packed ternary* (GGUF TQ1_0/TQ2_0/PQ2_0/PTQ1_0/Q2_0/Q1_0/STQ1_0/I2_S, BitNet,
   MLX 2-bit, already-canonical ``qweight``/``scales``), *dense ternary* (a float linear weight whose every
   group is exactly ``{-a, 0, +a}`` — unpacked Bonsai checkpoints; found by a full scan) or *copied*
   (norms, and float weights that are not ternary). One group size is chosen for the checkpoint: the
   smallest native one unless ``group_size`` asks otherwise (larger than the source = lossy = refused).
4. Jobs (one per source tensor) are decoded on a worker thread (Rust codecs release the GIL) two ahead of
   the writer, and streamed into shards — memory stays at a few tensors, not the model.
5. Output goes to a temporary sibling, gets a ``ternary_rs.json`` manifest (SHA-256 of sources and of every
   written file) and is renamed into place; ``dst`` is never replaced without ``force``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._core import FormatError, InvalidArgumentError, TernaryError, UnsupportedTypeError, ValidationError, __version__
from .arch import arch_for_config, arch_for_gguf
from .core.formats import (
    DETECT_GROUP,
    FLOAT_BYTES,
    GGUF_FLOAT_TYPE_IDS,
    GGUF_TERNARY_GROUPS,
    LLAMA_FILE_TYPES,
    dense_ternary_group,
    describe_non_ternary_types,
    float_view,
    gguf_output_types,
    non_ternary_gguf_tensors,
    packed_safetensors,
)
from .sinks.checkpoint import (
    GGUF_MARK_KEY,
    INDEX_NAME,
    SUPPORTED_GROUP_SIZES,
    TMP_MARK,
    ConversionError,
    Job,
    OutTensor,
    SourceHasher,
    Staging,
    check_destination_folder,
    check_disjoint,
    describe_error,
    parse_size,
    quantization_config,
    run_jobs,
    warn_literal_tilde,
    write_manifest,
    write_shards,
)
from .sinks.gguf_metadata import keep_source_metadata, keys_from_gguf, metadata_for_gguf_output
from .sources.hf_gguf import (
    GENERATION_CONFIG,
    SIDE_FILES,
    TOKENIZER_FILES,
    config_from_gguf,
    copy_hf_side_files,
    generation_config_from_gguf,
    tokenizer_from_gguf,
)
from .sources.reader import not_found, ternary_errors

log = logging.getLogger("ternary_rs.convert")

# Ternary GGUF types we write: (type id, values per block, bytes per block, canonical group size = the block).
GGUF_OUTPUT_TYPES = {name: (*ids, ids[1]) for name, ids in gguf_output_types("TQ1_0", "TQ2_0", "PQ2_0", "PTQ1_0",
                                                                             "STQ1_0").items()}
# llama.cpp ``general.file_type`` for the upstream types only (PQ2_0's 141 is the PrismML fork's, set by
# the qwen35 writer alone).
GGUF_FILE_TYPES = {name: LLAMA_FILE_TYPES[name] for name in ("TQ1_0", "TQ2_0", "STQ1_0")}
# --group-size with GGUF output: the group of a GGUF is its type's block, so the option cannot apply.
GGUF_GROUP_SIZE_MESSAGE = (
    "group_size={group_size} applies to vLLM output only: a GGUF's group is fixed by its type (TQ1_0/TQ2_0/STQ1_0: "
    "256, PQ2_0/PTQ1_0: 128); choose it with gguf_type")
# A source tensor's scales for a per-tensor format broadcast to this group when nothing else decides.
DEFAULT_GROUP_SIZE = 128


# ------------------------------------------------------------------------------------------ sources
@dataclass
class SourceTensor:
    """One weight of the source checkpoint, classified."""

    name: str                      # tensor name in the source file
    hf_name: str                   # Hugging Face name of the (logical) weight
    kind: str                      # "packed" | "canonical" | "dense" | "ternarize" | "copy"
    dtype: str                     # source storage type (GGUF type name or safetensors dtype)
    shape: tuple[int, ...]         # logical shape (PyTorch order; [N, K] for ternary)
    nbytes: int                    # bytes read from the source
    group: int | None = None       # native group (packed), max exact group (dense); None = per-tensor
    aux: tuple[str, ...] = ()      # further source tensors this one consumes (scales, biases…)
    candidate: bool = False        # a linear/embedding weight that could be ternary
    gguf_name: str | None = None
    expert: int | None = None      # slice e of a stacked [n_expert, N, K] tensor (MoE; nbytes per expert)

    @property
    def ternary(self) -> bool:
        return self.kind in ("packed", "canonical", "dense", "ternarize")


@dataclass
class ConvertOptions:
    """Options handed to arch hooks (``write_vllm_checkpoint``) and the writers."""

    to: str = "vllm"
    gguf_type: str | None = None
    group_size: int | None = None
    threads: int | None = None
    shard_size: int = 5 * 10**9
    force: bool = False
    discard_edits: bool = False     # with force: replace an output even where a file was edited since written
    progress: bool = True
    source_paths: list[Path] = field(default_factory=list)
    use_transformers: bool = True   # transformers may rebuild GGUF tokenizers the built-in rebuild does not cover
    requantize: bool = False        # allow a lossy regroup (re-ternarize with absmax) where a lossless one fails
    parents: bool = False           # create missing parent folders of the destination
    ternarize: bool = False         # dense linear weights -> ternary by the architecture's own convention
    digests: dict[str, Any] = field(default_factory=dict)  # SHA-256 (futures) of files already written
    # Set when the conversion is abandoned (error, Ctrl-C): long-running jobs check it between chunks.
    stop: threading.Event = field(default_factory=threading.Event)


class Source:
    """An opened source checkpoint with its architecture and classified tensors."""

    def __init__(self, path: Path, options: ConvertOptions):
        from .sources.reader import open as open_checkpoint

        self.path = path
        self.file = open_checkpoint(path)
        self.format = self.file.format
        self.is_gguf = self.format == "gguf"
        self.options = options
        self.skipped: list[str] = []
        if self.is_gguf:
            self.metadata = dict(self.file.metadata)
            arch_name = self.metadata.get("general.architecture")
            if not isinstance(arch_name, str):
                raise FormatError(f"{path}: GGUF metadata has no general.architecture")
            try:
                self.arch = arch_for_gguf(arch_name, self.metadata, list(self.file.tensors))
            except UnsupportedTypeError as e:
                raise UnsupportedTypeError(f"{path}: {e}") from None
            md = self.metadata
            heads = int(md.get(f"{arch_name}.attention.head_count", 0) or 0)
            self.shape_config = {
                "num_attention_heads": heads,
                "num_key_value_heads": int(md.get(f"{arch_name}.attention.head_count_kv", heads) or heads),
            }
            self.config: dict[str, Any] | None = None
        else:
            self.metadata = {}
            self.config = self._read_config()
            self.arch = arch_for_config(self.config)
            self.shape_config = self.config
            check = getattr(self.arch, "check_source_config", None)
            if check is not None:
                check(self.config, path, options)
        self.tensors: list[SourceTensor] = []

    # -- helpers
    @property
    def hf_dir(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    def _read_config(self) -> dict[str, Any]:
        config = getattr(self.file, "config", None)
        if config:
            return dict(config)
        p = self.hf_dir / "config.json"
        if not p.is_file():
            raise FormatError(f"{self.path}: no config.json next to the safetensors; cannot tell the architecture")
        return json.loads(p.read_text())

    def source_files(self) -> list[Path]:
        files = {Path(getattr(info, "file", self.path)) for info in self.file.tensors.values()}
        if self.is_gguf:
            files.add(self.path)
        else:
            for fname in ("config.json", INDEX_NAME) + SIDE_FILES:
                if (self.hf_dir / fname).is_file():
                    files.add(self.hf_dir / fname)
        return sorted(p.absolute() for p in files if Path(p).is_file())

    # -- classification
    def classify(self) -> list[SourceTensor]:
        self.tensors = self._classify_gguf() if self.is_gguf else self._classify_safetensors()
        candidates = [st for st in self.tensors if st.candidate]
        if candidates and not any(st.ternary for st in self.tensors):
            # The rule verify, inspect and plan apply too: nothing ternary = not a ternary model. Writing a
            # "ternary" checkpoint of float tensors would give an output that verify fails.
            types = ", ".join(sorted({st.dtype for st in candidates}))
            raise ConversionError(
                f"{self.path}: not a ternary checkpoint: all {len(candidates)} linear weights are dense float "
                f"({types}) with non-ternary values; nothing was written. ternary_rs converts ternary models; "
                "to ternarize a dense model on purpose use ternary_rs.ternarize (lossy)")
        return self.tensors

    def raw(self, st: SourceTensor):
        """The source bytes of ``st``: the whole tensor, or its expert's slice of a stacked tensor."""
        data = self.file.raw(st.name)
        if st.expert is None:
            return data
        return np.asarray(data).reshape(-1)[st.expert * st.nbytes:(st.expert + 1) * st.nbytes]

    def _float_or_copy(self, name, hf, info, shape, expert: int | None = None) -> SourceTensor:
        typ = info.type
        cand = self.arch.ternary_candidate(hf, shape)
        nbytes = int(info.nbytes) if expert is None else int(info.nbytes) // int(info.shape[0])
        st = SourceTensor(name, hf, "copy", typ, shape, nbytes, candidate=cand, expert=expert)
        if cand and typ in FLOAT_BYTES:
            g = dense_ternary_group(self.raw(st), typ, shape)
            if g is not None:
                st.kind, st.group = "dense", g
            elif self.options.ternarize:
                if getattr(self.arch, "ternarize_dense", None) is None:
                    raise ConversionError(
                        f"{self.path}: tensor {name}: --ternarize: architecture {self.arch.gguf_arch!r} defines no "
                        "ternarization of dense weights (ternary_rs.ternarize does it in Python)")
                st.kind = "ternarize"  # one scale per tensor: any group size holds it
            elif not getattr(self.arch, "dense_linears_allowed", True):
                raise ConversionError(
                    f"{self.path}: tensor {name} ({typ}) is a dense linear weight that is not exactly ternary with "
                    f"fp16 scales, which {self.arch.gguf_arch!r} serves only as ternary; pass --ternarize "
                    "(ternarize=True) to ternarize it")
        return st

    def _classify_gguf(self) -> list[SourceTensor]:
        arch, out = self.arch, []
        self.skipped = []
        n_blocks = arch.n_blocks_from_gguf(self.metadata, arch.gguf_arch)
        foreign = non_ternary_gguf_tensors(self.file.tensors)
        if foreign:  # all of them, up front (the rule inspect, verify and plan apply too)
            raise UnsupportedTypeError(f"{self.path}: {describe_non_ternary_types(foreign)}; nothing was written")
        for name, info in self.file.tensors.items():
            try:
                hf = arch.hf_name(name, n_blocks)
            except KeyError as e:
                raise ConversionError(f"{self.path}: {e.args[0]}") from None
            if hf is None:
                self.skipped.append(name)
                continue
            shape, typ = tuple(int(d) for d in info.shape), info.type
            if len(shape) == 3:
                out += self._expert_tensors(name, hf, info, shape)
            elif typ in GGUF_TERNARY_GROUPS:
                out.append(SourceTensor(name, hf, "packed", typ, shape, int(info.nbytes),
                                        group=GGUF_TERNARY_GROUPS[typ], candidate=True, gguf_name=name))
            elif typ in FLOAT_BYTES:
                st = self._float_or_copy(name, hf, info, shape)
                st.gguf_name = name
                out.append(st)
            else:
                raise UnsupportedTypeError(
                    f"{self.path}: tensor {name} has GGUF type {typ}; convertible types are the ternary "
                    f"{sorted(GGUF_TERNARY_GROUPS)} and the float {sorted(FLOAT_BYTES)}")
        return out

    def _expert_tensors(self, name, hf, info, shape) -> list[SourceTensor]:
        """A stacked Mixture-of-Experts tensor (llama.cpp's ``ffn_*_exps``, ``[n_expert, N, K]``) as one 2-D
        weight per expert, named by the architecture: expert e is the e-th contiguous slice of its bytes."""
        split = getattr(self.arch, "expert_hf_names", None)
        if split is None:
            raise ConversionError(f"{self.path}: tensor {name} is 3-D {list(shape)}, but architecture "
                                  f"{self.arch.gguf_arch!r} has no stacked experts")
        n_expert, rows, cols = shape
        typ, out = info.type, []
        for e, expert_hf in enumerate(split(hf, n_expert)):
            if typ in GGUF_TERNARY_GROUPS:
                out.append(SourceTensor(name, expert_hf, "packed", typ, (rows, cols), int(info.nbytes) // n_expert,
                                        group=GGUF_TERNARY_GROUPS[typ], candidate=True, gguf_name=name, expert=e))
            else:  # F16/BF16/F32 (anything else was refused up front)
                st = self._float_or_copy(name, expert_hf, info, (rows, cols), expert=e)
                st.gguf_name = name
                out.append(st)
        return out

    def _classify_safetensors(self) -> list[SourceTensor]:
        tensors = self.file.tensors
        packs = packed_safetensors(tensors)
        consumed = {a for _, aux in packs.values() for a in aux}
        out = []
        for name, info in tensors.items():
            if name in consumed:
                continue
            shape, typ = tuple(int(d) for d in info.shape), info.type
            kind, aux = packs.get(name, (None, ()))
            nbytes = int(info.nbytes) + sum(int(tensors[a].nbytes) for a in aux)
            if kind == "canonical":
                n, k = shape[0], shape[1] * 4
                out.append(SourceTensor(name, name[: -len(".qweight")] + ".weight", "canonical", typ, (n, k), nbytes,
                                        group=k // int(tensors[aux[0]].shape[1]), aux=aux, candidate=True))
            elif kind == "MLX":  # affine pack: 16 codes per uint32 along K
                n, k = shape[0], shape[1] * 16
                out.append(SourceTensor(name, name, "packed", "MLX", (n, k), nbytes,
                                        group=k // int(tensors[aux[0]].shape[1]), aux=aux, candidate=True))
            elif kind == "BITNET":  # transformers BitNet: 4 rows per byte, one scale per tensor
                out.append(SourceTensor(name, name, "packed", "BITNET", (shape[0] * 4, shape[1]), nbytes,
                                        group=None, aux=aux, candidate=True))
            else:
                out.append(self._float_or_copy(name, name, info, shape))
        return out

    # -- decoding to canonical form
    def canonical(self, st: SourceTensor, group_size: int):
        """``TernaryTensor`` of ``st`` at ``group_size`` in Hugging Face row order."""
        from .core.tensor import TernaryTensor, decode_bytes, recover_dense, repack
        from .sources.decode import decode

        n, k = st.shape
        if k % group_size:
            raise ValidationError(f"{self.path}: tensor {st.name}: K = {k} is not a multiple of group size {group_size}")
        if st.kind == "dense":
            exact = group_size if st.group is not None and st.group >= group_size else None
            if exact is None and not self.options.requantize:
                raise ValidationError(
                    f"{self.path}: tensor {st.name} is exactly ternary only for groups <= {st.group}; "
                    f"group size {group_size} would requantize it (pass --requantize to allow that)")
            t = recover_dense(self.raw(st), st.dtype, n, k, exact or st.group, name=st.name,
                              stop=self.options.stop)
        elif st.kind == "canonical":
            q = np.asarray(self.file.raw(st.name)).reshape(n, k // 4)
            s = np.asarray(self.file.raw(st.aux[0])).view(np.float16).reshape(n, k // st.group)
            try:
                t = TernaryTensor(q, s, st.group, name=st.name)
            except ValidationError as e:
                if "scale" not in str(e):
                    raise
                # A bad scale lives in the .scales tensor: name that one, not the codes beside it.
                raise ConversionError(f"{self.path}: tensor {st.aux[0]}: "
                                      f"{str(e).split(': ', 1)[-1]}") from None
        elif st.kind == "ternarize":
            t = self.arch.ternarize_dense(self.raw(st), st.dtype, st.shape, group_size, st.name)
        elif st.expert is not None:  # one expert of a stacked tensor
            t = decode_bytes(st.dtype, self.raw(st), (n, k), name=f"{st.name}[{st.expert}]")
        else:
            t = decode(self.file, st.name)
        if t.shape != (n, k):
            raise ValidationError(f"{self.path}: tensor {st.name} decoded to {t.shape}, expected {(n, k)}")
        if t.group_size != group_size:
            t = repack(t, group_size, requantize=self.options.requantize)
        perm = self.arch.rows_from_gguf(st.hf_name, self.shape_config, n) if self.is_gguf else None
        if perm is not None:
            t = TernaryTensor(np.ascontiguousarray(t.qweight[perm]), np.ascontiguousarray(t.scales[perm]),
                              t.group_size, name=st.name, validate=False)
        return t

    def raw_hf_order(self, st: SourceTensor) -> np.ndarray:
        """Raw bytes of a copied tensor, rows in Hugging Face order (and values, where the arch undoes
        llama.cpp's changes to them: ``values_from_gguf``)."""
        raw = self.raw(st)
        values = getattr(self.arch, "values_from_gguf", None) if self.is_gguf and st.shape else None
        if values is not None:
            changed = values(st.hf_name, raw, st.dtype, st.shape)
            return raw if changed is None else changed
        perm = (self.arch.rows_from_gguf(st.hf_name, self.shape_config, st.shape[0])
                if self.is_gguf and st.shape else None)
        if perm is None:
            return raw
        return np.ascontiguousarray(np.asarray(raw).reshape(st.shape[0], -1)[perm])


def choose_group_size(source: Source, requested: int | None) -> int:
    """One group size for the checkpoint: ``requested``, or the smallest native group of the sources."""
    groups = [st.group for st in source.tensors if st.ternary and st.group is not None]
    if requested is not None:
        if requested not in SUPPORTED_GROUP_SIZES:
            raise InvalidArgumentError(f"--group-size {requested} not in {SUPPORTED_GROUP_SIZES}")
        return requested
    g = min(groups) if groups else DEFAULT_GROUP_SIZE
    if g not in SUPPORTED_GROUP_SIZES:
        raise UnsupportedTypeError(f"{source.path}: native group size {g} is not one of {SUPPORTED_GROUP_SIZES}")
    return g


# ------------------------------------------------------------------------------------------ vLLM output
def _progress(total: int, desc: str, enabled: bool):
    """A progress bar on stderr, only when stderr is a terminal (a log file gets no redraw frames)."""
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not enabled or not sys.stderr.isatty(), leave=False)


def _vllm_jobs(source: Source, group_size: int) -> tuple[list[Job], list[str]]:
    jobs, not_converted = [], []
    for st in source.tensors:
        src_label = f"{source.path}: tensor {st.name}"
        if st.kind == "dense" and st.shape[1] % group_size:
            st.kind = "copy"  # dense weight whose K does not split into groups: keep it float
        if st.kind == "dense" and st.group is not None and st.group < group_size and not source.options.requantize:
            raise ValidationError(
                f"{src_label} is exactly ternary only for groups <= {st.group}; group size {group_size} "
                f"would requantize it (pass --group-size {st.group} or smaller, or --requantize)")
        if st.ternary:
            n, k = st.shape
            prefix = st.hf_name[: -len(".weight")] if st.hf_name.endswith(".weight") else st.hf_name

            def produce(st=st):
                t = source.canonical(st, group_size)
                return (np.ascontiguousarray(t.qweight, dtype=np.uint8),
                        np.ascontiguousarray(t.scales, dtype=np.float16))

            outs = [OutTensor(f"{prefix}.qweight", "U8", (n, k // 4), n * (k // 4)),
                    OutTensor(f"{prefix}.scales", "F16", (n, k // group_size), 2 * n * (k // group_size))]
            jobs.append(Job(outs, produce, src_label, st.nbytes))
        else:
            if st.candidate and st.hf_name.endswith(".weight"):
                not_converted.append(st.hf_name[: -len(".weight")])

            def produce(st=st):
                return (source.raw_hf_order(st),)

            jobs.append(Job([OutTensor(st.hf_name, st.dtype, st.shape, st.nbytes)], produce, src_label, st.nbytes))
    # Shards lay tensors out back to back: widest element first keeps every tensor aligned
    # (F32, then 16-bit, then qweight (N·K/4 bytes, a multiple of 8) + fp16 scales).
    width = {"F64": 0, "I64": 0, "U64": 0, "F32": 1, "I32": 1, "U32": 1, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
    jobs.sort(key=lambda j: 4 if j.outputs[0].name.endswith(".qweight") else width.get(j.outputs[0].dtype, 3))
    return jobs, not_converted


def _config_dtype(source: Source) -> str:
    if source.config and (source.config.get("dtype") or source.config.get("torch_dtype")):
        dtype = source.config.get("dtype") or source.config.get("torch_dtype")
        if dtype in ("float16", "bfloat16", "float32"):
            return dtype
    float_types = {st.dtype for st in source.tensors if st.dtype in FLOAT_BYTES and len(st.shape) == 2}
    return "bfloat16" if "BF16" in float_types else "float16"


def _gguf_side_files(source: Source, dtype: str, options: ConvertOptions, scratch: Path) -> dict[str, Any]:
    """config.json dict, with the tokenizer files rebuilt from GGUF metadata into ``scratch/tokenizer``;
    runs on a worker thread while the tensors stream."""
    config, meta_copy = config_from_gguf(
        source.path, source.metadata, list(source.file.tensors), source.arch, dtype, scratch,
        use_transformers=options.use_transformers)
    (scratch / "tokenizer").mkdir()
    if "tokenizer.ggml.tokens" not in source.metadata:
        log.warning("%s: the GGUF has no tokenizer (no tokenizer.ggml.tokens key), so no tokenizer files are "
                    "written (vLLM then needs --tokenizer)", source.path)
        return config
    tokenizer_from_gguf(meta_copy, source.metadata, scratch / "tokenizer")
    return config


def write_vllm_dir(source: Source, out_dir: Path, options: ConvertOptions) -> dict[str, Any]:
    """The generic dense-decoder writer: shards, config.json, tokenizer, generation config."""
    t0 = time.perf_counter()
    source.classify()
    group_size = choose_group_size(source, options.group_size)
    jobs, not_converted = _vllm_jobs(source, group_size)
    total = sum(j.source_bytes for j in jobs)
    t1 = time.perf_counter()
    dtype = _config_dtype(source)
    side_pool = side = scratch = None
    if source.is_gguf:  # config + tokenizer overlap the tensor streaming
        # A private scratch folder, a sibling named after the staging folder: a killed run's leftovers
        # are swept with it (remove_stale_temporaries).
        scratch = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}-meta-", dir=out_dir.parent))
        side_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ternary_rs-meta")
        side = side_pool.submit(_gguf_side_files, source, dtype, options, scratch)
    try:
        with _progress(total, f"convert {source.path.name}", options.progress) as bar:
            write_shards(out_dir, jobs, options.shard_size, bar, digests=options.digests)
    except BaseException:
        if side is not None:
            side.cancel()
            side_pool.shutdown(wait=False)
            shutil.rmtree(scratch, ignore_errors=True)  # a still-running side job fails on its own
        raise
    t2 = time.perf_counter()
    log.info("%s: classified %d tensors in %.1f s, wrote shards in %.1f s (%.2f GB/s of source)",
             source.path.name, len(jobs), t1 - t0, t2 - t1, total / max(t2 - t1, 1e-9) / 1e9)
    n_ternary = sum(1 for st in source.tensors if st.ternary)
    if n_ternary == 0:
        log.warning("%s: no ternary weights found; the output holds only float tensors", source.path)

    if source.is_gguf:
        try:
            config = side.result()
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        finally:
            side_pool.shutdown(wait=False)
        try:
            for f in sorted((scratch / "tokenizer").iterdir()):
                shutil.copyfile(f, out_dir / f.name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        gen = generation_config_from_gguf(source.metadata)
        if gen:
            (out_dir / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2) + "\n")
    else:
        config = dict(source.config)
        for stale in ("quantization_config", "quantization"):
            config.pop(stale, None)
        copy_hf_side_files(source.hf_dir, out_dir)
    config["quantization_config"] = quantization_config(group_size, not_converted)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    log.info("%s: config and tokenizer done %.1f s after the tensors", source.path.name, time.perf_counter() - t2)
    return {
        "group_size": group_size,
        "ternary_tensors": n_ternary,
        "copied_tensors": sum(1 for st in source.tensors if not st.ternary),
        "skipped_source_tensors": source.skipped,
        "modules_not_converted": sorted(not_converted),
    }


# ------------------------------------------------------------------------------------------ GGUF output
def _default_gguf_type(source: Source) -> str:
    types = {st.dtype for st in source.tensors if st.kind == "packed"}
    if len(types) == 1 and next(iter(types)) in GGUF_OUTPUT_TYPES:
        return next(iter(types))
    tern = [st for st in source.tensors if st.ternary]
    if tern and all((st.group is None or st.group >= 256) and st.shape[1] % 256 == 0 for st in tern):
        return "TQ2_0"  # upstream llama.cpp type, lossless here
    return "PQ2_0"


def _derived_gguf_jobs(source: Source) -> list[Job]:
    """Tensors llama.cpp derives from hyper-parameters (llama3's ``rope_freqs``): copied from a GGUF source
    as they are, computed from ``config.json`` as ``convert_hf_to_gguf.py`` computes them otherwise
    (``arch.gguf_extra_tensors``). First in the file, where upstream puts them. Without them llama.cpp
    silently runs an unscaled rope."""
    jobs = []
    if source.is_gguf:
        for name in source.skipped:
            info = source.file.tensors[name]
            if info.type != "F32":
                raise UnsupportedTypeError(f"{source.path}: tensor {name} is {info.type}; llama.cpp derives it "
                                           "as F32 and ternary_rs copies only that")
            shape = tuple(int(d) for d in info.shape)
            jobs.append(Job([OutTensor(name, "F32", shape, int(info.nbytes))],
                            lambda name=name: (np.ascontiguousarray(source.file.raw(name)).view(np.uint8).reshape(-1),),
                            f"{source.path}: tensor {name}", int(info.nbytes),
                            meta={"type_id": GGUF_FLOAT_TYPE_IDS["F32"]}))
        return jobs
    extra = getattr(source.arch, "gguf_extra_tensors", None)
    for name, values in (extra(source.config) if extra is not None else []):
        data = np.ascontiguousarray(values, dtype=np.float32)
        jobs.append(Job([OutTensor(name, "F32", data.shape, data.nbytes)],
                        lambda data=data: (data.view(np.uint8).reshape(-1),),
                        f"{source.path}: config.json ({name})", 0, meta={"type_id": GGUF_FLOAT_TYPE_IDS["F32"]}))
    return jobs


def write_gguf_file(source: Source, out_path: Path, options: ConvertOptions) -> dict[str, Any]:
    from .core.tensor import encode, repack
    from .sinks.writers import GGUFWriter

    source.classify()
    if any(st.expert is not None for st in source.tensors):  # llama.cpp wants the experts stacked again
        from .arch.moe import gguf_output_refused

        raise UnsupportedTypeError(gguf_output_refused(source.path, source.arch.gguf_arch))
    gtype = (options.gguf_type or _default_gguf_type(source)).upper()
    if gtype not in GGUF_OUTPUT_TYPES:
        raise UnsupportedTypeError(f"--gguf-type {gtype}: supported {sorted(GGUF_OUTPUT_TYPES)}")
    type_id, block_values, block_bytes, target_group = GGUF_OUTPUT_TYPES[gtype]
    file_type = GGUF_FILE_TYPES.get(gtype)
    if source.is_gguf:
        n_blocks = source.arch.n_blocks_from_gguf(source.metadata, source.arch.gguf_arch)
    else:
        n_blocks = int(source.config["num_hidden_layers"])

    jobs, fallback = _derived_gguf_jobs(source), []
    for st in source.tensors:
        gname = st.gguf_name or source.arch.gguf_name(st.hf_name, n_blocks)
        if gname is None:
            raise ConversionError(f"{source.path}: tensor {st.name} has no llama.cpp name in {source.arch.gguf_arch}")
        src_label = f"{source.path}: tensor {st.name}"
        n = st.shape[0] if st.shape else 0
        # Ternary tensors are decoded in Hugging Face row order (``Source.canonical`` undoes llama.cpp's q/k
        # permutation of a GGUF source), so they get llama.cpp's row order back whatever the source; float
        # tensors of a GGUF source are already in it.
        # Float tensors of an arch that changes values on the way (generic: Gemma's norm offset) take
        # ``values_to_gguf`` instead of a row permutation.
        values = None if st.ternary else getattr(source.arch, "values_to_gguf", None)
        perm = None if values is not None else source.arch.rows_to_gguf(st.hf_name, source.shape_config, n)
        if st.ternary and st.shape[1] % block_values == 0:
            n, k = st.shape
            nbytes = n * (k // block_values) * block_bytes

            def produce(st=st, perm=perm):
                t = source.canonical(st, min(target_group, st.group or target_group))
                # STQ1_0 regroups inside encode: its --requantize maps onto its codebook, not absmax.
                if t.group_size != target_group and gtype != "STQ1_0":
                    t = repack(t, target_group, requantize=source.options.requantize)
                if perm is not None:  # HF rows -> llama.cpp rows
                    from .core.tensor import TernaryTensor

                    t = TernaryTensor(np.ascontiguousarray(t.qweight[perm]), np.ascontiguousarray(t.scales[perm]),
                                      t.group_size, name=st.name, validate=False)
                data = encode(t, gtype, requantize=source.options.requantize and gtype == "STQ1_0")
                return (np.ascontiguousarray(np.frombuffer(memoryview(data), dtype=np.uint8)),)

            jobs.append(Job([OutTensor(gname, gtype, (n, k), nbytes)], produce, src_label, st.nbytes,
                            meta={"type_id": type_id}))
        elif st.ternary:
            # llama.cpp's converter falls back the same way when a row does not fill whole blocks;
            # F16 holds t·fp16(scale) exactly, so this is lossless.
            n, k = st.shape
            fallback.append(gname)

            def produce(st=st, perm=perm, k=k):
                t = source.canonical(st, st.group if st.group and k % st.group == 0 else DETECT_GROUP)
                w = t.dequantize("float16")  # exact t·scale in f32, rounded once
                if perm is not None:
                    w = w[perm]
                return (np.ascontiguousarray(w).view(np.uint8).reshape(-1),)

            jobs.append(Job([OutTensor(gname, "F16", (n, k), 2 * n * k)], produce, src_label, st.nbytes,
                            meta={"type_id": GGUF_FLOAT_TYPE_IDS["F16"]}))
        else:
            if st.dtype not in GGUF_FLOAT_TYPE_IDS:
                raise UnsupportedTypeError(f"{src_label}: dtype {st.dtype} cannot be written to GGUF "
                                           f"(supported: {sorted(GGUF_FLOAT_TYPE_IDS)})")

            # llama.cpp wants norms (1-D tensors) in F32, as convert_hf_to_gguf.py writes them.
            out_dtype = "F32" if len(st.shape) <= 1 or gname.endswith("_norm.weight") else st.dtype

            def produce(st=st, perm=None if source.is_gguf else perm, out_dtype=out_dtype,
                        values=None if source.is_gguf else values):
                raw = source.file.raw(st.name)
                if values is not None and st.shape:  # HF values -> llama.cpp's
                    changed = values(st.hf_name, raw, st.dtype, st.shape)
                    raw = raw if changed is None else changed
                if perm is not None:  # HF rows -> llama.cpp rows
                    raw = np.asarray(raw).reshape(st.shape[0], -1)[perm]
                if out_dtype != st.dtype:
                    raw = float_view(raw, st.dtype).view(np.uint8)
                return (np.ascontiguousarray(raw).reshape(-1),)

            n_out = int(np.prod(st.shape)) * FLOAT_BYTES[out_dtype] if st.shape else FLOAT_BYTES[out_dtype]
            jobs.append(Job([OutTensor(gname, out_dtype, st.shape, n_out)], produce, src_label, st.nbytes,
                            meta={"type_id": GGUF_FLOAT_TYPE_IDS[out_dtype]}))
    if fallback:
        log.warning("%s: rows of %s are not a multiple of %d values; written as F16", source.path,
                    ", ".join(fallback), block_values)

    # Tokenizer and general.* keys: the source GGUF's (or the one a checkpoint was converted from), else
    # rebuilt from the Hugging Face files as convert_hf_to_gguf.py does (size_label needs the tensors).
    if source.is_gguf:
        metadata = keys_from_gguf(source.metadata, source.file.metadata_types, file_type)
    else:
        metadata = metadata_for_gguf_output(source.hf_dir, source.config, source.arch, file_type,
                                            [j.outputs[0].shape for j in jobs])
    # The mark lets a later ``--force`` tell this file from a user's own GGUF (which it never replaces).
    metadata.append((GGUF_MARK_KEY, __version__, "string"))
    writer = GGUFWriter(out_path)
    try:
        for key, value, vtype in metadata:
            writer.add_metadata(key, value, vtype)
        for job in jobs:
            o = job.outputs[0]
            writer.add_tensor_info(o.name, tuple(o.shape), job.meta["type_id"], o.nbytes)

        def consume(i, job, buffers):
            writer.write_tensor_data(job.outputs[0].name, buffers[0])

        with _progress(sum(j.source_bytes for j in jobs), f"convert {source.path.name}", options.progress) as bar:
            run_jobs(jobs, consume, bar)
    except BaseException:
        writer.abort()  # deletes the partial file
        raise
    writer.close()
    return {"gguf_type": gtype, "tensors": len(jobs), "f16_fallback": fallback, "skipped_source_tensors": source.skipped}


# ------------------------------------------------------------------------------------------ entry points
class BulkConversionError(ConversionError):
    """Some inputs of a bulk job failed; ``results`` and ``failures`` hold the details."""

    def __init__(self, message: str, results: list[Path], failures: list[tuple[Path, BaseException]]):
        super().__init__(message)
        self.results = results
        self.failures = failures


class BulkInterrupted(KeyboardInterrupt):
    """A bulk job interrupted (Ctrl-C, SIGTERM): ``results`` are the outputs completed before it (complete
    and kept), ``current`` the input whose conversion was abandoned (nothing of it is left)."""

    def __init__(self, results: list[Path], current: Path):
        super().__init__(f"interrupted while converting {current}; {len(results)} outputs were complete")
        self.results = list(results)
        self.current = current


def _expand_sources(src) -> tuple[list[Path], bool]:
    """Paths from one path, a glob, or a list of them; second item: whether this is a bulk job."""
    items = list(src) if isinstance(src, (list, tuple)) else [src]
    bulk = isinstance(src, (list, tuple)) and len(items) != 1
    paths: list[Path] = []
    for item in items:
        text = os.fspath(item)
        if glob.has_magic(text):
            matches = sorted(glob.glob(text))
            if not matches:
                raise not_found(text)
            paths += [Path(m) for m in matches]
            bulk = True
        else:
            paths.append(Path(text))
    return paths, bulk or len(paths) > 1


def default_output_name(src: Path, to: str, gguf_type: str | None) -> str:
    stem = src.parent.name if src.name.endswith(".index.json") else (src.name if src.is_dir() else src.stem)
    return f"{stem}-{(gguf_type or 'ternary').upper()}.gguf" if to == "gguf" else stem


def _may_be_rotated(meta: dict[str, Any]) -> bool:
    """Cheap pre-check for ``hadamard.is_rotated`` (prism.hadamard.* keys, a Bonsai 2 MLX config, or a
    converted checkpoint's ``quantization_config.hadamard``)."""
    qc = meta.get("quantization_config")
    return (any(str(k).startswith("prism.") for k in meta) or "hadamard" in str(meta.get("model_type", ""))
            or (isinstance(qc, dict) and "hadamard" in qc))


def _hide_staging(e: BaseException, dst: Path) -> BaseException:
    """``e`` with the hidden staging folder (``.<name>.ternary_rs-tmp-<pid>-<nonce>``, and its
    ``-meta-`` scratch sibling) replaced by the user's destination in its message: errors name the
    path the user asked for, never a temporary they cannot see."""
    hidden = r"\." + re.escape(dst.name + TMP_MARK) + r"\d+-[0-9a-f]+(?:-meta-[A-Za-z0-9_]+)?"
    pattern = re.compile(f"(?:{re.escape(str(dst.absolute().parent) + os.sep)})?{hidden}")

    def fix(text):
        return pattern.sub(lambda m: str(dst) if m.group(0).startswith(os.sep) else dst.name, text) \
            if isinstance(text, str) else text

    if isinstance(e, OSError):
        if e.errno is not None and (e.filename or e.strerror):
            fixed = type(e)(e.errno, fix(e.strerror), fix(e.filename)) if e.filename else type(e)(e.errno, fix(e.strerror))
        else:
            fixed = type(e)(fix(str(e)))
        return e if str(fixed) == str(e) else fixed
    if isinstance(e, (TernaryError, ValueError)):
        text = str(e)
        if fix(text) == text:
            return e
        try:
            return type(e)(fix(text))
        except TypeError:  # an exception class that takes other arguments: keep it as it is
            return e
    return e


def _convert_one(src: Path, dst: Path, options: ConvertOptions) -> Path:
    try:
        return _convert_one_unchecked(src, dst, options)
    except BaseException as e:
        fixed = _hide_staging(e, dst)
        if fixed is e:
            raise
        raise fixed from e


def _convert_one_unchecked(src: Path, dst: Path, options: ConvertOptions) -> Path:
    if not src.exists():
        raise not_found(src)
    check_disjoint([src], dst)
    source = Source(src, options)
    # An architecture's own GGUF writer (qwen35: prism.hadamard.*, GDN layouts) for non-GGUF sources.
    gguf_hook = None if source.is_gguf else getattr(source.arch, "write_gguf", None)
    # Bonsai 2 rotation: only paths that keep it may run (a dropped rotation serves garbage, silently).
    keeps_rotation = (source.is_gguf and options.to == "gguf") or (options.to == "gguf" and gguf_hook is not None) or (
        options.to != "gguf" and getattr(source.arch, "write_vllm_checkpoint", None) is not None)
    if not keeps_rotation and _may_be_rotated(source.metadata or source.config or {}):
        from .core.hadamard import refuse_if_rotated  # imports torch: only when there is something to refuse

        refuse_if_rotated(source.metadata or source.config or {}, f"this conversion to {options.to}", str(src))
    options.source_paths = source.source_files()
    check_disjoint(options.source_paths, dst)  # e.g. the shards an index.json points at
    hasher = SourceHasher(options.source_paths)
    try:
        if options.to == "gguf":
            with (staging := Staging(dst, force=options.force, directory=False, parents=options.parents,
                                    discard_edits=options.discard_edits)) as tmp:
                if gguf_hook is not None:
                    gguf_hook(source.file, tmp, options)
                else:
                    write_gguf_file(source, tmp, options)
                hasher.cancel()  # a GGUF carries no manifest: no need to finish hashing the sources
                source.file.check_unchanged()  # a source that changed while read: keep nothing
                staging.commit()
            return dst
        with (staging := Staging(dst, force=options.force, directory=True, parents=options.parents,
                                discard_edits=options.discard_edits)) as tmp:
            hook = getattr(source.arch, "write_vllm_checkpoint", None)
            if hook is not None:
                hook(source.file, tmp, options)
                details = {"writer": f"arch.{source.arch.gguf_arch}.write_vllm_checkpoint"}
            else:
                details = write_vllm_dir(source, tmp, options)
            if source.is_gguf:  # lets a later conversion back to GGUF restore every key (tokenizer scores …)
                keep_source_metadata(options.source_paths[0], tmp)  # the GGUF itself, also when src is its folder
            t0 = time.perf_counter()
            sources = hasher.result()
            t1 = time.perf_counter()
            write_manifest(tmp, sources, {
                "architecture": source.arch.gguf_arch,
                "source_format": source.format,
                "conversion": {"to": "vllm", **details},
                "options": {"group_size": options.group_size, "shard_size": options.shard_size,
                            "requantize": options.requantize, "ternarize": options.ternarize},
            }, digests=options.digests)
            log.info("%s: waited %.1f s for source SHA-256, output SHA-256 + manifest in %.1f s",
                     src.name, t1 - t0, time.perf_counter() - t1)
            source.file.check_unchanged()  # a source that changed while read: keep nothing
            staging.commit()
        return dst
    except BaseException:
        options.stop.set()
        hasher.cancel()
        raise


def _refuse_colliding_outputs(sources: list[Path], targets: list[Path]) -> None:
    """Bulk jobs: two inputs mapping to one output would overwrite each other; refuse before converting."""
    by_target: dict[Path, list[Path]] = {}
    for s, t in zip(sources, targets):
        by_target.setdefault(t.resolve(), []).append(s)
    clashes = [(t, srcs) for t, srcs in by_target.items() if len(srcs) > 1]
    if clashes:
        lines = "\n".join(f"  {t}: from {', '.join(map(str, srcs))}" for t, srcs in clashes)
        raise ConversionError(f"{len(clashes)} output name(s) would be written by more than one input; nothing "
                              f"was converted (convert those inputs one at a time, each to its own "
                              f"destination):\n{lines}")


def output_kind(dst, to: str | None, bulk: bool = False) -> str:
    """``"vllm"`` or ``"gguf"``: ``to`` if given, else GGUF for a destination named ``*.gguf`` (a single
    conversion), a vLLM directory otherwise. ``to="vllm"`` with a ``*.gguf`` name is refused: it would
    make a directory that looks like a file."""
    text = os.fspath(dst)
    looks_gguf = text.lower().endswith(".gguf")
    if text.endswith(("/", os.sep)) and text.rstrip("/" + os.sep).lower().endswith(".gguf") and not bulk \
            and not (to == "gguf" and Path(text).is_dir()):
        # "out.gguf/" names a folder (as the shell and every tool read a trailing slash) that looks like a
        # file: refused rather than silently made (--to gguf into an existing folder of that name is fine).
        raise ConversionError(f"{text}: a trailing '/' names a folder, but this name ends in .gguf; drop the '/' "
                              "to write a GGUF file, or choose a folder name")
    if to is None:
        return "gguf" if looks_gguf and not bulk else "vllm"
    if to not in ("vllm", "gguf"):
        raise InvalidArgumentError(f"--to {to}: expected vllm or gguf")
    if to == "vllm" and looks_gguf and not bulk:
        raise ConversionError(f"{dst}: --to vllm writes a directory, but this name ends in .gguf; drop --to vllm "
                              "to write a GGUF file, or choose a folder name")
    return to


@ternary_errors()
def convert(src, dst, to: str | None = None, gguf_type: str | None = None, group_size: int | None = None,
            threads: int | None = None, shard_size: int | str = "5GB", force: bool = False,
            progress: bool = True, *, use_transformers: bool = True, requantize: bool = False,
            parents: bool = False, ternarize: bool = False, discard_edits: bool = False):
    """Convert a ternary checkpoint into a vLLM directory (``to="vllm"``) or a ternary GGUF (``to="gguf"``;
    the default when ``dst`` ends in ``.gguf``, see :func:`output_kind`).

    ``src`` is a GGUF, a safetensors file, a sharded ``*.index.json`` or a Hugging Face directory; a list or
    a glob makes a *bulk job*: ``dst`` is then a folder receiving one output per input, a failing input
    does not stop the others, and :class:`BulkConversionError` lists the failures at the end.
    ``requantize`` allows a lossy regroup (re-ternarized with absmax) where a lossless one is impossible;
    ``parents`` creates a missing parent folder of ``dst`` (refused otherwise: a typo is not created).
    ``ternarize`` (opt-in, lossy by nature): dense float linear weights that are not already ternary are
    ternarized by the architecture's own training convention (BitNet: per tensor by absmean, exactly as
    transformers' ``WeightQuant``); architectures without one refuse it.
    ``force`` replaces an existing output that ternary_rs wrote; if a file in it was changed since (its
    SHA-256 no longer matches the manifest) it is refused unless ``discard_edits`` is set too.
    Returns the output path (bulk: the list of outputs).
    """
    sources, bulk = _expand_sources(src)
    if not bulk:
        check_disjoint(sources, dst)  # first of all: a destination that is or holds the source is refused
    tilde = warn_literal_tilde(dst)
    if tilde:
        log.warning("%s", tilde)
    to = output_kind(dst, to, bulk)
    if gguf_type and to != "gguf":
        raise InvalidArgumentError(f"--gguf-type {gguf_type} applies to GGUF output only (--to gguf, or a destination "
                         "ending in .gguf)")
    if group_size is not None and to == "gguf":
        raise InvalidArgumentError(GGUF_GROUP_SIZE_MESSAGE.format(group_size=group_size))
    if threads is not None:
        if int(threads) < 1:
            raise InvalidArgumentError(f"--threads {threads}: must be at least 1")
        from ._core import set_num_threads

        set_num_threads(int(threads))
    options = ConvertOptions(to=to, gguf_type=gguf_type.upper() if gguf_type else None, group_size=group_size,
                             threads=threads, shard_size=parse_size(shard_size), force=force,
                             progress=progress, use_transformers=use_transformers, requantize=requantize,
                             parents=parents, ternarize=ternarize, discard_edits=discard_edits)
    if requantize:
        log.warning("--requantize: weights that cannot be regrouped losslessly are re-ternarized (they change)")
    if not bulk:
        target = Path(dst)
        if to == "gguf" and target.is_dir():  # a folder: the GGUF goes inside it
            target = target / default_output_name(sources[0], to, options.gguf_type)
        return _convert_one(sources[0], target, options)
    out_root = Path(dst)
    if (out_root.exists() and not out_root.is_dir()) or out_root.suffix.lower() == ".gguf":
        raise ConversionError(f"{out_root}: a bulk job writes one output per input into a folder; name a folder")
    targets = [out_root / default_output_name(s, to, options.gguf_type) for s in sources]
    _refuse_colliding_outputs(sources, targets)
    created: list[Path] = []
    if not out_root.is_dir():
        check_destination_folder(out_root, parents)
        created = [q for q in reversed(out_root.absolute().parents) if not q.exists()] + [out_root.absolute()]
        out_root.mkdir(parents=True, exist_ok=True)
    else:
        check_destination_folder(out_root / "x", parents)  # out_root itself inside an output?
    results: list[Path] = []
    failures: list[tuple[Path, BaseException]] = []
    for s, target in zip(sources, targets):
        try:
            results.append(_convert_one(s, target, ConvertOptions(**{**options.__dict__, "source_paths": [],
                                                                     "digests": {}, "stop": threading.Event()})))
        except (TernaryError, OSError, ValueError, KeyError) as e:
            failures.append((s, e))  # reported once, at the end
        except KeyboardInterrupt as e:  # the outputs already renamed into place are complete: say which
            raise BulkInterrupted(results, s) from e
    if failures and not results:  # nothing was written: the folders this run made go again
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                break
    if failures:
        lines = "\n".join(f"  {p}: {describe_error(e, p)}" for p, e in failures)
        raise BulkConversionError(f"{len(failures)} of {len(sources)} conversions failed:\n{lines}", results, failures)
    return results


def dequantize_checkpoint(vllm_dir, out_dir, dtype: str = "float32") -> Path:
    """Write a plain Hugging Face checkpoint (dense weights) from a ternary vLLM directory.

    Reads with ``safetensors`` and dequantizes with ``TernaryTensor.dequantize`` (``W = (code − 1) · scale``), so tests can
    load the result in transformers and compare logits.
    """
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from .core.tensor import TernaryTensor

    vllm_dir, out_dir = Path(vllm_dir), Path(out_dir)
    config = json.loads((vllm_dir / "config.json").read_text())
    qc = config.pop("quantization_config", None) or {}
    if qc.get("quant_method") != "ternary":
        raise ValidationError(f"{vllm_dir}/config.json: quantization_config.quant_method is not 'ternary'")
    group_size = int(qc["group_size"])
    rotation = None
    if qc.get("hadamard") is not None:
        from .core.hadamard import HadamardSpec, unrotate_weight

        rotation = HadamardSpec.from_config(qc["hadamard"])
    np_dtype = {"float32": np.float32, "float16": np.float16}.get(dtype)
    if np_dtype is None:
        raise InvalidArgumentError(f"dtype {dtype!r}: expected float32 or float16")
    try:
        import torch  # noqa: F401

        framework = "pt"
    except ImportError:
        framework = "numpy"
    out_dir.mkdir(parents=True, exist_ok=True)
    index = json.loads((vllm_dir / INDEX_NAME).read_text())
    weight_map: dict[str, str] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors: dict[str, np.ndarray] = {}
        with safe_open(str(vllm_dir / shard), framework=framework) as f:
            keys = set(f.keys())

            def get(name):
                t = f.get_tensor(name)
                if framework == "pt":  # torch reads BF16, which NumPy cannot hold
                    t = (t.float() if t.is_floating_point() else t).numpy()
                return t

            for name in sorted(keys):
                if name.endswith(".scales") and name[: -len(".scales")] + ".qweight" in keys:
                    continue
                if name.endswith(".qweight"):
                    prefix = name[: -len(".qweight")]
                    # validate=False: a stored code 3 dequantizes to +2·scale, as before.
                    scales = get(prefix + ".scales").astype(np.float16)  # F16 on disk; get() may widen it
                    w = TernaryTensor(get(name), scales, group_size, name=prefix,
                                      validate=False).dequantize("float32")
                    if rotation is not None:  # Bonsai 2: the dense model is W'·H·D, not W'
                        w = unrotate_weight(w, rotation, prefix)
                    tensors[prefix + ".weight"] = w.astype(np_dtype)
                else:
                    t = get(name)
                    tensors[name] = t.astype(np_dtype) if t.dtype.kind == "f" else t
        for name in tensors:
            weight_map[name] = shard
        save_file(tensors, str(out_dir / shard), metadata={"format": "pt"})
    (out_dir / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    config["dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for fname in TOKENIZER_FILES + (GENERATION_CONFIG,):
        if (vllm_dir / fname).is_file():
            (out_dir / fname).write_bytes((vllm_dir / fname).read_bytes())
    return out_dir


__all__ = [
    "BulkConversionError", "BulkInterrupted", "ConversionError", "ConvertOptions", "convert", "dequantize_checkpoint",
]
