"""The vLLM-on-CPU settings that are fastest for a ternary model, chosen where the user set none.

vLLM CPU's defaults are made for large servers and fail or idle on small machines:

* ``VLLM_CPU_NUM_OF_RESERVED_CPU``: vLLM keeps one core per worker out of the compute for its front end.
  On a 2-core machine that halves the compute of every decode step, while the front end needs a
  fraction of a core (measured, Bonsai-1.7B shape, closed-loop clients: 12.1 -> 16.9 tok/s at 1 client,
  46.5 -> 80.8 at 16). Up to :data:`RESERVE_NONE_MAX_CORES` usable cores we reserve none; above, the
  reserved core is a small share and keeps the OpenMP barrier of every op free of the front end's
  preemptions, so vLLM's default stays.
* ``VLLM_CPU_OMP_THREADS_BIND``: vLLM's ``auto`` (one OpenMP thread per physical core, on the worker's
  NUMA node) is already the fastest binding for a bandwidth-bound ternary decode (a second hyperthread
  adds no memory bandwidth); it is kept and reported. But ``auto`` gives each tensor-parallel rank a NUMA
  node of its own and refuses to start when there are fewer nodes than ranks (every desktop and most
  cloud VMs have one): there the usable CPUs are split into one contiguous range per rank instead.
* ``VLLM_USE_LAYERNAME=0`` (``ternary-rs serve`` only: vLLM reads it when imported, before a plugin runs):
  layer names as strings, so the plugin can run the compiled graph through inductor's C++ wrapper
  (``ternary_rs.vllm.plugin.cpp_wrapper_choice``; 1.7B shape, batch 1, 2 AVX2 cores: +5-8 % tok/s).
* ``--dtype bfloat16`` (``ternary-rs serve`` only: vLLM fixes the dtype before a plugin runs, so inside
  vLLM it is reported, not set) for a float16 checkpoint on x86 CPUs with native bf16 but no fp16
  arithmetic (:func:`dtype_choice`).
* The KV cache space: without ``VLLM_CPU_KVCACHE_SPACE`` or ``--kv-cache-memory-bytes`` vLLM CPU asks for
  ``--gpu-memory-utilization`` (0.9) of the *total* RAM to be *available* at start-up, which no
  machine running anything else has, and dies after loading the model. :func:`kv_cache_space` sizes
  it from the plan instead (see there).

One home for the rule: ``ternary-rs serve`` passes the choices to vLLM's server in its environment and
prints them; the vLLM plugin applies the same ones for ``vllm.LLM(...)`` and
``python -m vllm.entrypoints.openai.api_server`` users (``ternary_rs.vllm.plugin``). A setting the user
made (the variable in the environment, ``--kv-cache-memory-bytes``) always wins.
"""

from __future__ import annotations

import functools
import math
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1 << 30
RESERVE_NONE_MAX_CORES = 4
# Memory left to everything else on the machine: this fraction of the available RAM, at least 1 GiB.
SAFETY_FRACTION = 0.15
SAFETY_MIN_BYTES = GIB
# The KV space aimed for: room for this many sequences of this many tokens (or all of max_num_seqs at
# full length, if smaller), and at least this much: many clients with short prompts need pages, not length.
TYPICAL_SEQUENCES = 64
TYPICAL_TOKENS = 1024
MIN_TARGET_BYTES = 4 * GIB
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
# Read by vLLM when it is imported (vllm.utils.torch_utils), so only a server started with it can use it.
LAYER_NAME_ENV = "VLLM_USE_LAYERNAME"


def ours_unless_vllm(variable: str) -> bool:
    """Whether one of ternary_rs's replacements of a vLLM CPU function is on: the environment ``variable`` is
    ``auto`` (the default: ours) or ``vllm`` (keep vLLM's); any other value is refused with a ValueError."""
    choice = os.environ.get(variable, "auto").strip().lower()
    if choice not in ("auto", "vllm"):
        raise ValueError(f"{variable}={choice!r}: expected auto or vllm")
    return choice == "auto"


class DoesNotFit(ValueError):
    """Not even one sequence of ``max_model_len`` tokens fits beside the weights."""


@dataclass
class Choice:
    name: str
    value: str
    why: str
    by_user: bool = False
    vllm_default: bool = False  # reported only: vLLM already does this when the variable is unset
    variable: bool = True  # an environment variable (False: a vLLM config entry or command-line option)
    flag: str | None = None  # the vLLM server option ``serve`` passes it as (``--dtype``)

    def line(self) -> str:
        who = ("yours" + (f"; {self.why}" if self.why else "")) if self.by_user else self.why
        return f"{self.name}={self.value} ({who})"


@dataclass
class CpuSettings:
    choices: list[Choice] = field(default_factory=list)
    kv_bytes: int | None = None  # chosen KV cache space (None: the user's own)

    @property
    def env(self) -> dict[str, str]:
        """The variables ternary_rs chose (the user's are already in the environment; vLLM's own
        defaults are left unset, so nothing is written that a later TP size could contradict)."""
        return {c.name: c.value for c in self.choices if not c.by_user and not c.vllm_default and c.variable}

    @property
    def args(self) -> list[str]:
        """The vLLM server options ternary_rs chose (``serve`` appends them to the command)."""
        return [a for c in self.choices if c.flag and not c.by_user and not c.vllm_default for a in (c.flag, c.value)]

    def summary(self) -> str:
        return ", ".join(c.line() for c in self.choices)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _node_of_first_cpu() -> int:
    try:
        cpu = min(os.sched_getaffinity(0))
        nodes = [p.name for p in Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*")]
        return int(nodes[0][4:]) if nodes else 0
    except (AttributeError, OSError, ValueError):
        return 0


def _cgroup_available() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def available_ram() -> int | None:
    """The memory vLLM CPU itself counts as available when it sizes and checks the KV cache: on the NUMA
    node of the first CPU it may run on (vLLM binds its memory there), free + file cache + reclaimable
    slab, clamped by a cgroup limit; ``MemAvailable`` where there is no per-node information."""
    fields: dict[str, int] = {}
    meminfo = Path(f"/sys/devices/system/node/node{_node_of_first_cpu()}/meminfo")
    try:
        for line in meminfo.read_text().splitlines():  # "Node 0 MemFree:  8940396 kB"
            parts = line.split()
            fields[parts[2].rstrip(":")] = int(parts[3]) * 1024
        node = sum(fields[k] for k in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))
    except (OSError, ValueError, IndexError, KeyError):
        node = None
    if node is None:
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    node = int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    cgroup = _cgroup_available()
    return min(node, cgroup) if node is not None and cgroup is not None else node


def _usable_cpu_ids() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _numa_nodes(cpus: list[int]) -> int:
    """How many NUMA nodes the usable CPUs span (1 where sysfs does not say)."""
    nodes = set()
    for cpu in cpus:
        nodes.update(p.name for p in Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
    return max(1, len(nodes))


def split_binding(cpus: list[int], parts: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``parts`` ranks a contiguous share of ``cpus``
    (``"0-7|8-15"``; ids that are not contiguous are listed)."""
    per, extra = divmod(len(cpus), parts)
    out, start = [], 0
    for r in range(parts):
        ids = cpus[start:start + per + (r < extra)]
        start += len(ids)
        contiguous = ids == list(range(ids[0], ids[-1] + 1))
        out.append(f"{ids[0]}-{ids[-1]}" if contiguous and len(ids) > 1 else ",".join(map(str, ids)))
    return "|".join(out)


def bind_choice(env: dict[str, str], tensor_parallel: int, cpus: list[int] | None = None,
                nodes: int | None = None) -> Choice:
    bind = env.get(BIND_ENV, "")
    if bind != "":
        return Choice(BIND_ENV, bind, "", by_user=True)
    cpus = _usable_cpu_ids() if cpus is None else cpus
    nodes = _numa_nodes(cpus) if nodes is None else nodes
    if tensor_parallel > 1 and nodes < tensor_parallel and len(cpus) >= tensor_parallel:
        return Choice(BIND_ENV, split_binding(cpus, tensor_parallel),
                      f"{tensor_parallel} ranks on {nodes} NUMA node(s): vLLM's auto binding needs a node per rank")
    return Choice(BIND_ENV, "auto", "vLLM's: one thread per physical core", vllm_default=True)


def layer_name_choice(env: dict[str, str]) -> Choice:
    """``VLLM_USE_LAYERNAME=0``: vLLM's attention ops then take their layer's name as a plain string instead
    of torch's opaque ``LayerName`` object, which inductor's C++ graph wrapper cannot pass; with strings
    the plugin can turn that wrapper on (:func:`ternary_rs.vllm.plugin.cpp_wrapper_choice`), which takes
    the per-step Python of the compiled graph away."""
    if env.get(LAYER_NAME_ENV, "") != "":
        return Choice(LAYER_NAME_ENV, env[LAYER_NAME_ENV], "", by_user=True)
    return Choice(LAYER_NAME_ENV, "0", "layer names as strings, so the compiled graph can run in C++")


def reserved_cpus_choice(env: dict[str, str], cores: int) -> Choice | None:
    if env.get(RESERVED_ENV, "") != "":
        return Choice(RESERVED_ENV, env[RESERVED_ENV], "", by_user=True)
    if cores <= RESERVE_NONE_MAX_CORES:
        return Choice(RESERVED_ENV, "0", f"{cores} cores: none kept idle for vLLM's front end")
    return None


@dataclass(frozen=True)
class Paging:
    """The vLLM cache settings that decide how many pages a sequence takes (vLLM 0.32, CPU)."""
    # Prefix caching (vLLM's default) puts hybrid models in mamba cache mode "align": every linear-attention
    # layer holds two state pages per sequence (the running state and the last block boundary's), not one.
    mamba_align: bool = True
    block_size: int | None = None  # the user's --block-size; vLLM CPU's own default is CPU_BLOCK_SIZE
    # Bytes per element of the Gated-DeltaNet recurrent state as vLLM CPU stores it (recurrent_state_bytes).
    recurrent_bytes: int = field(default_factory=lambda: recurrent_state_bytes())

    @staticmethod
    def of(prefix_caching: bool, mamba_cache_mode: str, block_size: int | None,
           ssm_cache_dtype: str = "auto") -> Paging:
        """From vLLM's settings: mode "align" is asked for, or set by vLLM when prefix caching is on and the
        mode was left at "none"; the recurrent state's width from ``--mamba-ssm-cache-dtype``."""
        return Paging(mamba_align=mamba_cache_mode == "align" or (mamba_cache_mode == "none" and prefix_caching),
                      block_size=block_size or None, recurrent_bytes=recurrent_state_bytes(ssm_cache_dtype))


def recurrent_state_bytes(ssm_cache_dtype: str = "auto") -> int:
    """Bytes per element of a hybrid model's recurrent (SSM) state in vLLM CPU 0.32: an explicit
    ``--mamba-ssm-cache-dtype`` is kept (for the Gated-DeltaNet models served here); ``auto`` is the conv
    state's dtype — the model's, bf16 — except on CPUs with AVX512_BF16, where vLLM's platform resets it to
    float32 for its accelerated GDN kernels (``CpuPlatform.check_and_update_config``). So an AVX2 CPU
    holds half the state an AVX-512 one does (tiny qwen35 at 1 GiB on EPYC Zen 2: vLLM's concurrency 780,
    not the 468 of an fp32 state)."""
    if ssm_cache_dtype == "float32":
        return 4
    if ssm_cache_dtype in ("bfloat16", "float16"):
        return 2
    flags = cpu_flags()
    if flags is None:
        return 4  # unknown CPU: the larger state, so what is sized to fit fits either way
    return 4 if "avx512_bf16" in flags else 2


_CPU_FLAGS: frozenset[str] | None = None


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags (``/proc/cpuinfo``; what torch's ``_is_avx512_bf16_supported`` asks too,
    without importing torch); ``None`` where there is no such file."""
    global _CPU_FLAGS
    if _CPU_FLAGS is None:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("flags"):
                    _CPU_FLAGS = frozenset(line.partition(":")[2].split())
                    break
        except OSError:
            return None
    return _CPU_FLAGS


CPU_BLOCK_SIZE = 128  # vLLM CPU's default KV block (tokens); also the alignment of a hybrid model's block
CPU_KERNEL_BLOCK = 32  # the CPU attention backend takes blocks of multiples of this


@dataclass(frozen=True)
class SequenceSizes:
    """What one sequence costs vLLM, from ``plan``, and everything else it holds."""
    context: int  # max_model_len
    kv_per_token: int  # all attention layers
    state: int  # recurrent + conv state of all linear-attention layers
    attention_layers: int
    linear_layers: int
    fixed: int  # weights, activations, runtime
    paging: Paging = Paging()

    def vllm_bytes(self, tokens: int) -> int:
        """Bytes vLLM's KV cache manager takes for one sequence of ``tokens`` tokens.

        Attention is paged in whole blocks. A hybrid model costs more than ``state + tokens · kv_per_token``
        (vLLM 0.32, ``Platform._align_hybrid_block_size`` and ``kv_cache_utils``): the attention block is
        grown, in steps of the block alignment, until one layer's block holds at least one linear-attention
        layer's state, and that state page is padded to the same size; the layers of each kind form groups
        of equal size (the smaller count, or the larger when it is under 1.5× the smaller); a sequence takes
        one page (two with prefix caching: :attr:`Paging.mamba_align`) per linear-attention group and, per
        attention group, one page per block of tokens. Bonsai 2 27B (48 + 16 layers, ~3.2 MB of state per
        layer): 896-token blocks of 3.67 MB pages; a 1024-token sequence takes 5 pages × 16 layers ≈ 294 MB
        without prefix caching, 8 × 16 ≈ 470 MB with it (221 MB of state and KV)."""
        state_pages = 2 if self.paging.mamba_align else 1
        if not self.attention_layers:
            return state_pages * self.state
        block, page, group = self._geometry()
        if not (self.state and self.linear_layers):
            return math.ceil(tokens / block) * page
        pages = (state_pages * math.ceil(self.linear_layers / group)
                 + math.ceil(self.attention_layers / group) * math.ceil(tokens / block))
        return group * page * pages

    def one_sequence_bytes(self, tokens: int) -> int:
        """KV space vLLM needs to admit one sequence of ``tokens`` tokens: :meth:`vllm_bytes` plus the
        block its pool always holds back (the null block; 59 MB at the 27B shape: without it a length
        fitted to the byte was refused, "10.99 GiB KV cache is needed … available 10.95 GiB")."""
        if not self.attention_layers:
            return self.vllm_bytes(tokens) + self.state
        _, page, group = self._geometry()
        return self.vllm_bytes(tokens) + group * page

    def _geometry(self) -> tuple[int, int, int]:
        """``(tokens per block, bytes per page, layers per group)``; a model without linear attention has
        one group of all its layers, whose page is a block of every layer."""
        block = self.paging.block_size or CPU_BLOCK_SIZE
        per_layer_token = self.kv_per_token // self.attention_layers
        if not (self.state and self.linear_layers):
            return block, block * self.kv_per_token, 1
        state_page = self.state // self.linear_layers
        align = max(CPU_KERNEL_BLOCK, block)
        block = max(block, align * math.ceil(state_page / (align * per_layer_token)))
        small, large = sorted((self.attention_layers, self.linear_layers))
        return block, block * per_layer_token, large if large < 1.5 * small else small


def _sizes(model: str | os.PathLike, max_model_len: int | None, kv_dtype: str, available: int,
           paging: Paging = Paging()) -> SequenceSizes:
    from ..inspection.planner import plan

    p = plan(model, context=max_model_len or 2048, concurrency=1, gpu_memory=f"{available}B", kv_dtype=kv_dtype,
             gpu_memory_utilization=1.0)
    planned = int(p["state_per_sequence"])
    # The plan counts an fp32 recurrent state; vLLM CPU may hold it narrower (recurrent_state_bytes).
    recurrent = int(p.get("recurrent_state_per_sequence") or 0)
    state = planned - recurrent + recurrent * paging.recurrent_bytes // 4
    return SequenceSizes(int(p["context"]), int(p["kv_cache_per_token"]), state, int(p["attention_layers"]),
                         int(p.get("linear_attention_layers") or 0), int(p["total"]) - int(p["kv_cache"]) - planned,
                         paging)


def users_kv_space(gib_text: str) -> int | None:
    """The bytes a ``VLLM_CPU_KVCACHE_SPACE`` value (GiB) gives the KV cache; ``None`` when it is not a finite
    number (unset, or text vLLM refuses in its own words)."""
    try:
        gib = float(gib_text)
    except ValueError:
        return None
    return int(gib * GIB) if math.isfinite(gib) else None


def check_users_kv_space(model: str | os.PathLike, gib_text: str, *, max_model_len: int | None,
                         max_num_seqs: int | None = None, kv_dtype: str = "fp16", paging: Paging = Paging()) -> str:
    """Raise :class:`DoesNotFit` when the user's ``VLLM_CPU_KVCACHE_SPACE`` cannot hold one
    ``max_model_len`` sequence (vLLM would refuse it after loading the model). Otherwise return a note
    when it caps how many sequences run at once below ``max_num_seqs`` (vLLM queues the rest, silently:
    a 27B hybrid at 1 GiB ran 4 of a batch of 8), else ``""``. A value that is not a number is left for
    vLLM to refuse in its own words."""
    space = users_kv_space(gib_text)
    if space is None:
        return ""
    z = _sizes(model, max_model_len, kv_dtype, available_ram() or GIB, paging)
    one = z.one_sequence_bytes(z.context)
    if one > space:
        raise DoesNotFit(f"one {z.context}-token sequence needs {one / GIB:.1f} GiB of KV cache and recurrent "
                         f"state, more than the {gib_text} GiB {KV_ENV} you set")
    tokens = min(z.context, TYPICAL_TOKENS)
    fits = int(space // z.vllm_bytes(tokens))
    if max_num_seqs and fits < min(max_num_seqs, TYPICAL_SEQUENCES):
        return (f"room for about {fits} sequences of {tokens} tokens at once, fewer than max_num_seqs "
                f"{max_num_seqs}: the rest wait")
    return ""


def kv_cache_space(model: str | os.PathLike, *, max_model_len: int | None, max_num_seqs: int | None,
                   kv_dtype: str = "fp16", available: int | None = None,
                   paging: Paging = Paging()) -> tuple[int, str]:
    """``(bytes, why)``: the KV cache space (whole GiB, as ``VLLM_CPU_KVCACHE_SPACE`` takes it) for ``model``.

    ``budget`` = available RAM − everything ``plan`` counts besides the KV cache and recurrent state
    (weights as vLLM holds them, activations of one step, runtime) − a safety margin
    (:data:`SAFETY_FRACTION` of the available RAM, at least 1 GiB). The space aimed for is room for
    ``min(max_num_seqs, TYPICAL_SEQUENCES)`` sequences of ``min(max_model_len, TYPICAL_TOKENS)`` tokens
    (as vLLM pages them: :meth:`SequenceSizes.vllm_bytes`), at least :data:`MIN_TARGET_BYTES` and one full
    ``max_model_len`` sequence; it gets the aim rounded up to whole GiB, or the budget's whole GiB if
    fewer, never less than one full sequence
    (raises :class:`DoesNotFit` when the budget cannot hold that)."""
    available = available_ram() if available is None else available
    if available is None:
        raise DoesNotFit("the available RAM is unknown (no /proc/meminfo)")
    z = _sizes(model, max_model_len, kv_dtype, available, paging)
    context, fixed = z.context, z.fixed
    budget, safety = _budget(z, available)
    one = z.one_sequence_bytes(context)
    seqs = min(max_num_seqs or TYPICAL_SEQUENCES, TYPICAL_SEQUENCES)
    tokens = min(context, TYPICAL_TOKENS)
    typical = z.vllm_bytes(tokens)
    aim = max(MIN_TARGET_BYTES, one, seqs * typical)
    need_gib = max(1, math.ceil(one / GIB))
    # Whole GiB up, where the budget allows: rounding down left room for fewer sequences than aimed for.
    gib = max(need_gib, min(math.ceil(aim / GIB), int(budget // GIB)))
    if gib * GIB > budget:
        raise DoesNotFit(
            f"one {context}-token sequence needs {need_gib} GiB of KV cache and recurrent state, but only "
            f"{max(0, budget) / GIB:.1f} GiB are left of the {available / GIB:.1f} GiB of available RAM after "
            f"the weights, activations and runtime ({fixed / GIB:.1f} GiB) and a {safety / GIB:.1f} GiB margin")
    fits = int(gib * GIB // typical)
    # Say what the space holds, not only what was aimed for: capped by the budget it holds fewer (a 27B
    # hybrid on 24 GB: about 25 of 64), and a user sizing a client pool needs that number.
    room = (f"room for {seqs} sequences of {tokens} tokens" if fits >= seqs else
            f"room for about {fits} sequences of {tokens} tokens, of the {seqs} aimed for (the RAM left caps it;"
            f" shorter sequences take less)")
    why = (f"GiB: {available / GIB:.1f} GiB available - {fixed / GIB:.1f} GiB weights, activations and runtime"
           f" - {safety / GIB:.1f} GiB margin, {room}")
    return gib * GIB, why


def _budget(z: SequenceSizes, available: int) -> tuple[int, int]:
    """``(bytes left for the KV cache, safety margin)``: the available RAM less what ``plan`` counts besides
    the KV cache and state, less the margin (:data:`SAFETY_FRACTION`, at least :data:`SAFETY_MIN_BYTES`)."""
    safety = max(SAFETY_MIN_BYTES, int(available * SAFETY_FRACTION))
    return available - z.fixed - safety, safety


def fitting_context(model: str | os.PathLike, longest: int, *, kv_dtype: str = "fp16", paging: Paging = Paging(),
                    space: int | None = None, available: int | None = None, step: int = 1024) -> int:
    """The longest ``max_model_len`` (a multiple of ``step``, at most ``longest``) whose one sequence fits
    in ``space`` bytes of KV cache, or by default in the whole GiB of the budget :func:`kv_cache_space`
    works with; 0 when not even ``step`` tokens fit."""
    available = available_ram() if available is None else available
    if available is None:
        return 0
    z = _sizes(model, None, kv_dtype, available, paging)
    if space is None:
        space = _whole_gib_budget(z, available)
    lo, hi = 0, longest // step  # one_sequence_bytes grows with the length: the largest fitting multiple
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if z.one_sequence_bytes(mid * step) <= space:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def budget_space(model: str | os.PathLike, *, kv_dtype: str = "fp16", available: int | None = None) -> int:
    """The whole GiB of KV space the budget of :func:`kv_cache_space` allows, whatever the length (0 when
    the available RAM is unknown or the weights leave none)."""
    available = available_ram() if available is None else available
    if available is None:
        return 0
    return _whole_gib_budget(_sizes(model, None, kv_dtype, available), available)


def _whole_gib_budget(z: SequenceSizes, available: int) -> int:
    """:func:`_budget`'s bytes for the KV cache in whole GiB (what ``VLLM_CPU_KVCACHE_SPACE`` can say)."""
    return max(0, int(_budget(z, available)[0] // GIB)) * GIB


def choose(model: str | os.PathLike, *, env: dict[str, str] | None = None, max_model_len: int | None = None,
           max_num_seqs: int | None = None, kv_dtype: str = "fp16", kv_bytes_given: bool = False,
           cores: int | None = None, available: int | None = None, tensor_parallel: int = 1,
           paging: Paging = Paging(), starts_vllm: bool = False) -> CpuSettings:
    """The settings for serving ``model`` with vLLM CPU, the user's own ones (``env``,
    ``kv_bytes_given``: ``--kv-cache-memory-bytes``) kept and reported as theirs. ``starts_vllm``: the
    caller starts vLLM's process (``serve``), so the variables vLLM reads when imported
    (``VLLM_USE_LAYERNAME``) are chosen too; inside vLLM (the plugin) they are too late."""
    env = dict(os.environ if env is None else env)
    out = CpuSettings()
    reserved = reserved_cpus_choice(env, usable_cores() if cores is None else cores)
    if reserved is not None:
        out.choices.append(reserved)
    out.choices.append(bind_choice(env, tensor_parallel))
    if starts_vllm:
        out.choices.append(layer_name_choice(env))
    if env.get(KV_ENV, "") != "":
        note = check_users_kv_space(model, env[KV_ENV], max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                    kv_dtype=kv_dtype, paging=paging)
        out.choices.append(Choice(KV_ENV, env[KV_ENV], note, by_user=True))
    elif not kv_bytes_given:
        space, why = kv_cache_space(model, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                    kv_dtype=kv_dtype, available=available, paging=paging)
        out.kv_bytes = space
        out.choices.append(Choice(KV_ENV, str(space // GIB), why))
    return out


def checkpoint_dtype(checkpoint: str | os.PathLike) -> str | None:
    """The float dtype a checkpoint's ``config.json`` declares (``dtype``, older ``torch_dtype``; a
    multimodal config's ``text_config``), or None."""
    import json

    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for c in (config, config.get("text_config") or {}):
        dtype = c.get("dtype") or c.get("torch_dtype")
        if isinstance(dtype, str):
            return dtype
    return None


def dtype_choice(checkpoint: str | os.PathLike, user_dtype: str | None) -> Choice | None:
    """vLLM's compute dtype for serving ``checkpoint`` on this CPU: **bfloat16** where the checkpoint says
    float16 and the CPU has native bf16 arithmetic (AVX512_BF16 or AMX) — but not native fp16 (no x86
    CPU vLLM runs on computes fp16 natively outside AMX-FP16, so torch converts every fp16 element and
    vLLM's CPU attention and norms take their slower fp16 paths). A GGUF converts to a float16 config
    when it carries no BF16 tensor (llama.cpp writes F16; ``convert`` keeps what the file says). The
    ternary linear layers quantize their activations to int8 per group either way, and bf16 has f32's
    range where fp16 overflows at 65504; llama.cpp itself keeps activations in f32. Measured, EPYC Zen 5,
    2 threads, Bonsai-1.7B shape from a TQ2_0 GGUF, compiled, batch 1 / 16, two rounds: float16 55.7 /
    57.1 and 222.4 / 223.0 tok/s, bfloat16 68.5 / 67.8 and 220.1 / 214.9. The user's ``--dtype`` wins;
    None when there is nothing to choose or report."""
    if user_dtype is not None:
        return Choice("dtype", user_dtype, "", by_user=True, variable=False)
    if checkpoint_dtype(checkpoint) == "float16" and bf16_not_fp16():
        return Choice("dtype", "bfloat16", "the checkpoint says float16; this CPU has native bf16 arithmetic, "
                      "not fp16", variable=False, flag="--dtype")
    return None


def bf16_not_fp16() -> bool:
    """Whether this CPU computes bf16 natively but not fp16: x86 with AVX512_BF16 or AMX (aarch64 CPUs
    with bf16 have fp16 arithmetic too, and are left to the checkpoint's dtype)."""
    return platform.machine().lower() in ("x86_64", "amd64") and bf16_gemm_is_native()


@functools.cache
def bf16_gemm_is_native() -> bool:
    """Whether torch's bf16 GEMM on this CPU is oneDNN's (AVX512_BF16 or AMX; aarch64: left to vLLM) rather
    than the scalar fallback. Where it is not, the plugin takes over the bf16 work vLLM CPU would hand it:
    the Gated-DeltaNet prefill (``ternary_rs.vllm.gdn_prefill``) and dense layers (``ternary_rs.vllm.dense``)."""
    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
