"""The GPU memory plan: one budget for everything the server puts on a device.

`gpu_memory_utilization` (vLLM's name and meaning) is a fraction of the device's memory. Inside
that budget live, in the order they are planned:

- **context**: the device memory outside torch's allocator (the CUDA context, kernel modules,
  other libraries' buffers), measured once the profiling forwards ran: what `nvidia-smi` counts
  and torch does not (on an H100 with CUDA 13 about 0.8 GiB, which an early plan left out, so
  that `nvidia-smi` read 2 % over the budget under load);
- **weights**: measured once they are resident (`torch.cuda.memory_allocated`);
- **activations**: the peak of one forward at the largest step, measured by a profiling
  forward (vLLM's profile run), or estimated from the config offline (`kvtier plan`), plus one
  prompt chunk's attention over a full context (`attention_estimate`, the formula below; at
  start `profile_attention` also runs it on the device over a full context and takes the
  larger, as SDPA's flash kernel may add accumulators): the profiling forwards' contexts are
  short, while a prefilling row of a mixed step copies its whole context's K and
  V out of the pages, one copy per query head (kvtier.paged.reference._flash_lower_right, in
  groups of heads of at most `FLASH_KV_BYTES`; all of Qwen2-7B's copies at once are 348 MB
  at 24K tokens). The rows and layers attend one after another, so one row's worth at a
  time:
  `batch_tokens * heads * head_dim * e + 2 * c * ctx * head_dim * e + c * batch_tokens *
  (head_dim * e + 4)`, `ctx` the context rounded up to whole pages of 256, `c` the query heads
  per call (`FLASH_KV_BYTES // (2 * ctx * head_dim * e)`, 1 to `heads`), `e` the dtype's
  bytes: 137.0 MiB for Qwen2-7B in bf16 at 32K tokens and a 1,024-token step;
- **graphs**: the CUDA graphs of the batched step, every bucket captured into one shared
  memory pool: the largest bucket's intermediates plus the one logits buffer they all write
  (estimated here, then measured after the capture and recorded);
- **staging**: the transfer engine's staging buffers (part of `l1_bytes`);
- **l1**: the cache's own GPU buffers (the rest of `l1_bytes`);
- **inflight**: copies in flight (a commit's or an eviction's device buffers waiting for L2 or
  L3), bounded by the cache;
- **pool**: the batch's KV page pool, which gets what is left;
- **headroom**: what the allocator needs besides (rounding, fragmentation), kept free.

A budget too small for the weights plus one full-context session is refused at start with the
figures and what fits. `l1_bytes` and `batch_kv_bytes` stay as overrides, checked against the
budget. The plan is pure arithmetic (`plan_memory`) plus measurements (`profile_activations`,
`profile_attention`, `profile_graphs`, `DeviceMemoryPlan.measured`); the server builds it once
the weights are resident (kvtier.server.http.app), and the same arithmetic prints offline as
`kvtier plan --gpu`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.humanize import size as _fmt
from kvtier.paged.attention import VARLEN_PAGE, varlen_block_table_supported
from kvtier.paged.reference import prefill_attention_bytes
from kvtier.server.config import ServerConfig

log = logging.getLogger("kvtier.server")

PARTS = (
    "context", "weights", "activations", "graphs", "staging", "l1", "inflight", "pool", "headroom",
)  # fmt: skip
# The context's bytes where nothing measured them (`kvtier plan` offline): what an H100 with
# CUDA 13 and torch 2.11 held outside torch's allocator once the server was ready.
CONTEXT_ESTIMATE = 800 << 20
# Kept free besides the parts: the caching allocator rounds blocks (2 MiB for large ones) and
# keeps freed blocks of one size apart from another's. At most this many bytes, and at most
# HEADROOM_SHARE of the budget on a small device.
HEADROOM_BYTES = 512 << 20
HEADROOM_SHARE = 0.02
# The staging engine's bound of one group's buffer and its groups (kvtier.transfer.device):
# four buffers per engine on a GPU, two per direction.
_GROUP_BYTES = 128 << 20
_MAX_GROUP = 4
_STAGES = 4
PAGE_SIZE = 16  # tokens per KV page (CPU, or where FlashAttention's varlen cannot run)
_CPU_POOL_CAP = 2**30  # an automatic pool on the CPU takes at most this many bytes
# Copies in flight the cache may hold on the device besides the staging buffers, as a
# multiple of them (the cache bounds its own; this is the share the plan sets aside).
INFLIGHT_STAGINGS = 1
# Tokens of the L1 room the server's warm-up needs (its measured prefill of 2,048 tokens and a
# suffix, rounded up to whole chunks): with paged L1 the cache's L1 holds nothing else.
WARM_UP_L1_TOKENS = 2048 + 32 + 256 + 224  # its prefill prompt and suffix, in whole chunks


@dataclasses.dataclass(frozen=True)
class DeviceMemoryPlan:
    """Bytes of each part of one device's budget; `headroom` is what the parts leave free."""

    device: str
    total_bytes: int  # the device's memory (or the cap it runs under)
    utilization: float
    context: int
    weights: int
    activations: int
    graphs: int
    staging: int
    l1: int
    inflight: int
    pool: int
    # measured after the fact (graph capture, staging built): part -> bytes
    measured: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    @property
    def headroom(self) -> int:
        return self.budget_bytes - sum(getattr(self, p) for p in PARTS[:-1])

    @property
    def allocator_fraction(self) -> float:
        """The cap on torch's allocator, as a fraction of the device: the budget less the
        context, which the allocator never sees."""
        return max(0.0, (self.budget_bytes - self.context) / self.total_bytes)

    @property
    def l1_bytes(self) -> int:
        """The cache's `l1_bytes`: its L1 buffers and the staging buffers they come out of."""
        return self.l1 + self.staging

    def parts(self) -> dict[str, int]:
        """Each part's planned bytes, in plan order; they sum to `budget_bytes`."""
        return {p: int(getattr(self, p)) for p in PARTS}

    def used_bytes(self) -> int:
        """The process's device bytes now: what torch's allocator holds on the device."""
        dev = torch.device(self.device)
        if dev.type != "cuda":
            return 0
        return int(torch.cuda.memory_reserved(dev))

    def with_measured(self, **parts: int) -> DeviceMemoryPlan:
        """The plan with measured figures recorded beside the planned ones."""
        return dataclasses.replace(self, measured={**self.measured, **parts})

    def describe(self) -> str:
        """One line: the budget, each part's bytes (a measured figure beside it) and headroom."""
        shown = []
        for p in PARTS:
            text = f"{p} {_fmt(getattr(self, p))}"
            if p in self.measured:
                text += f" (measured {_fmt(self.measured[p])})"
            shown.append(text)
        return (
            f"GPU memory plan on {self.device}: budget {_fmt(self.budget_bytes)} "
            f"({self.utilization:.2f} of {_fmt(self.total_bytes)}): " + ", ".join(shown)
        )


def staging_estimate(chunk_bytes: int, lossless: bool = True) -> int:
    """The transfer engine's staging buffers for chunks of `chunk_bytes` (native codec: four
    group buffers; a quantizing codec adds its rows and scratch, about as much again)."""
    group = max(1, min(_MAX_GROUP, _GROUP_BYTES // max(1, chunk_bytes)))
    return _STAGES * group * chunk_bytes * (1 if lossless else 2)


def activation_estimate(
    hidden: int, intermediate: int, vocab: int, tokens: int, logits_rows: int, element: int
) -> int:
    """Offline guess of one forward's peak over its weights: a few hidden-sized and MLP-sized
    tensors per token alive at once, and the kept rows' logits in float32."""
    per_token = (6 * hidden + 3 * intermediate) * element
    return tokens * per_token + logits_rows * vocab * 4


def attention_estimate(
    geometry: Any, heads: int, context_tokens: int, query_tokens: int, page: int = VARLEN_PAGE
) -> int:
    """The peak bytes of one prompt chunk's attention of `query_tokens` over `context_tokens`,
    one layer of one row, in the batched step's prefill path (`prefill_attention_bytes`): what
    the profiling forwards, whose contexts are short, do not reach. `page`: the pool's page
    size (the context is read in whole pages; 256 rounds up as far as any)."""
    return prefill_attention_bytes(
        context_tokens=context_tokens,
        query_tokens=query_tokens,
        heads=heads,
        kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        element=geometry.element_size,
        page_size=page,
    )


def profile_attention(
    geometry: Any,
    heads: int,
    context_tokens: int,
    query_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """`attention_estimate` on this device, or more where the device needs more: the prefill
    attention run over one layer's K/V of a full context for chunks of up to `query_tokens`
    (the peak bytes it allocates beyond its inputs; SDPA's flash kernel may add float32
    accumulators when it splits the context, which the formula leaves out). CUDA only; the
    temporary K/V are freed again."""
    from kvtier.paged.reference import _flash_lower_right

    page = page_size(device, dtype)
    term = attention_estimate(geometry, heads, context_tokens, query_tokens, page)
    pages = -(-context_tokens // page)
    shape = (pages, page, geometry.num_kv_heads, geometry.head_dim)
    table = torch.arange(pages, dtype=torch.int32, device=device)
    measured = 0
    with torch.inference_mode():
        k_cache = torch.randn(shape, dtype=dtype, device=device)
        v_cache = torch.randn(shape, dtype=dtype, device=device)
        longest = min(query_tokens, context_tokens)  # a chunk's tokens are in its context
        for n_q in sorted({min(longest, n) for n in (16, 128, 512, longest)}):
            q = torch.randn((n_q, heads, geometry.head_dim), dtype=dtype, device=device)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            out = _flash_lower_right(q, k_cache, v_cache, table, context_tokens, 1.0)
            torch.cuda.synchronize(device)
            measured = max(measured, torch.cuda.max_memory_allocated(device) - base)
            del out, q
        del k_cache, v_cache
    return max(term, int(measured))


def graph_estimate(activations: int, logits_rows: int, vocab: int, element: int) -> int:
    """One shared pool for every bucket: the largest bucket's intermediates (`activations`, the
    buckets captured largest first reuse them) plus the one logits buffer every graph copies its
    kept rows into (`logits_rows`: the batch's sequences)."""
    return activations + logits_rows * vocab * element


def plan_memory(
    *,
    device: str,
    total_bytes: int,
    utilization: float,
    weights: int,
    activations: int,
    graphs: int,
    staging: int,
    per_token: int,
    context_tokens: int,
    l1_bytes: int = 0,
    inflight: int | None = None,
    pool_bytes: int = 0,
    context: int = CONTEXT_ESTIMATE,
) -> DeviceMemoryPlan:
    """The plan of one device, or a ConfigError saying what fits.

    `per_token` is the KV bytes of one token; one full-context session (`context_tokens` of
    them) is the smallest page pool worth serving.
    `l1_bytes` (the cache's L1 with its staging) and `pool_bytes` are overrides; 0 means the
    plan sizes them (L1: the staging plus the warm-up's room; the pool: what is left).
    """
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization: {utilization} is not in (0, 1]")
    budget = int(total_bytes * utilization)
    headroom = min(HEADROOM_BYTES, int(budget * HEADROOM_SHARE))
    inflight = INFLIGHT_STAGINGS * staging if inflight is None else inflight
    session_bytes = per_token * context_tokens
    l1_total = l1_bytes or staging + per_token * min(context_tokens, WARM_UP_L1_TOKENS)
    if l1_total <= staging:
        raise ConfigError(
            f"l1_bytes ({_fmt(l1_total)}) must exceed the transfer engine's staging buffers "
            f"({_fmt(staging)}); raise l1_bytes or leave it out (the plan sizes it)"
        )
    fixed = context + weights + activations + graphs + l1_total + inflight + headroom
    left = budget - fixed
    pool = pool_bytes or left
    parts = (
        f"the CUDA context {_fmt(context)}, weights {_fmt(weights)}, activations {_fmt(activations)}, CUDA graphs {_fmt(graphs)}, "
        f"L1 with staging {_fmt(l1_total)}, copies in flight {_fmt(inflight)}, headroom "
        f"{_fmt(headroom)}"
    )
    if pool_bytes and pool_bytes > left:
        raise ConfigError(
            f"batch_kv_bytes ({_fmt(pool_bytes)}) does not fit the GPU memory budget: "
            f"{_fmt(budget)} ({utilization:.2f} of {_fmt(total_bytes)}) less {parts} leaves "
            f"{_fmt(max(0, left))}. Lower batch_kv_bytes to at most that, leave it out (the pool "
            "gets what is left), or raise --gpu-memory-utilization"
        )
    if pool < session_bytes:
        need = fixed + session_bytes
        fits = (
            f"raise --gpu-memory-utilization to at least {need / total_bytes:.2f}"
            if need <= total_bytes
            else f"this device ({_fmt(total_bytes)}) is too small for it (it needs "
            f"{_fmt(need)}); use a larger GPU or a smaller model"
        )
        tokens = max(0, pool) // max(1, per_token) // 256 * 256
        if tokens >= 256:
            fits += f", or serve shorter contexts: --max-model-len {tokens} fits"
        raise ConfigError(
            f"the GPU memory budget of {_fmt(budget)} ({utilization:.2f} of "
            f"{_fmt(total_bytes)}) holds {parts} and leaves {_fmt(max(0, pool))} for the page "
            f"pool, less than one full-context session ({_fmt(session_bytes)}); {fits}"
        )
    return DeviceMemoryPlan(
        device=device,
        total_bytes=int(total_bytes),
        utilization=float(utilization),
        context=int(context),
        weights=int(weights),
        activations=int(activations),
        graphs=int(graphs),
        staging=int(staging),
        l1=int(l1_total - staging),
        inflight=int(inflight),
        pool=int(pool),
    )


def profile_activations(model: Any, tokens: int, logits_rows: int, device: torch.device) -> int:
    """The peak bytes one forward of `tokens` tokens adds over what is resident (vLLM's profile
    run): a plain forward without a cache, keeping `logits_rows` rows of logits. CUDA only."""
    from kvtier.paged import ATTN_NAME

    vocab = int(model.get_input_embeddings().num_embeddings)
    ids = (torch.arange(tokens, device=device) % vocab).unsqueeze(0)
    previous = model.config._attn_implementation  # noqa: SLF001  # transformers' field, no public getter
    if previous == ATTN_NAME:  # a batch runner took the model over: profile the plain path
        model.set_attn_implementation("sdpa")
    try:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=False, logits_to_keep=max(1, logits_rows))
            out.logits.float()  # the sampler's upcast of the kept rows
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out, ids
    finally:
        model.set_attn_implementation(previous)
    return int(peak)


def model_kv(model: Any) -> tuple[Any, torch.dtype, int]:
    """The model's KV geometry, its weights' dtype and the KV bytes of one token in it."""
    from kvtier.geometry import KVGeometry

    dtype = next(model.parameters()).dtype
    element = torch.empty((), dtype=dtype).element_size()
    geometry = KVGeometry.from_config(model.config)
    return (
        geometry,
        dtype,
        geometry.num_layers * 2 * geometry.num_kv_heads * geometry.head_dim * element,
    )


def build_plan(served: Any, config: ServerConfig) -> DeviceMemoryPlan | None:
    """The plan of the served model's device, built once its weights are resident, and the
    budget enforced: torch's allocator refuses to hold more than it on this device (an
    allocation past it raises out-of-memory in kvtier, not in another process on the GPU).

    None on the CPU, and for a model placed across devices (each device's share is planned by
    its failover, kvtier.server.devices.failover)."""
    device = served.device
    if device.type != "cuda" or served.devices is not None:
        return None
    model = served.model
    geometry, dtype, per_token = model_kv(model)
    max_batch = int(config.max_concurrency)
    batch_tokens = max(int(config.batch_tokens), max_batch)
    torch.cuda.synchronize(device)
    weights = int(torch.cuda.memory_allocated(device))
    # the largest step: the batch's (its kept rows' logits), or a session's prefill forward
    # through the cache (every prompt token's logits)
    batch = profile_activations(model, batch_tokens, max_batch, device)
    # a session's forward through the cache (the warm-up; requests with batching off) keeps
    # its last token's logits alone
    step = int(config.prefill_step)
    activations = max(batch, profile_activations(model, step, 1, device))
    # one prefilling row's attention over the whole context (the profiles' contexts are short)
    attention = profile_attention(
        geometry,
        int(model.config.num_attention_heads),
        int(served.context_tokens),
        batch_tokens,
        device,
        dtype,
    )
    graphs = 0
    if config.batching and config.cuda_graphs:
        # measured: the step captured once over a pool of two pages, then freed (the graphs'
        # memory does not depend on the pool's size); the estimate missed it 5x on a 7B model
        # (the rows kernel's split buffers of every bucket)
        graphs, eager = profile_graphs(model, geometry, dtype, config, int(served.context_tokens))
        activations = max(activations, eager)
    log.info(
        "GPU memory plan: activations %s measured + %s for a prompt chunk's attention over a "
        "%d-token context",
        _fmt(activations),
        _fmt(attention),
        int(served.context_tokens),
    )
    activations += attention
    chunk = geometry.chunk_bytes(int(config.chunk_tokens))
    staging = staging_estimate(chunk, lossless=str(config.codec) == "native")
    total = int(torch.cuda.get_device_properties(device).total_memory)
    plan = plan_memory(
        context=context_bytes(device),
        device=str(device),
        total_bytes=total,
        utilization=float(config.gpu_memory_utilization),
        weights=weights,
        activations=activations,
        graphs=graphs,
        staging=staging,
        per_token=per_token,
        context_tokens=int(served.context_tokens),
        l1_bytes=int(config.l1_bytes),
        pool_bytes=int(config.batch_kv_bytes),
    )
    torch.cuda.empty_cache()  # the profile's blocks go back: the pool is sized to need them
    # torch's allocator gets the budget less the context, which lives outside it
    torch.cuda.set_per_process_memory_fraction(plan.allocator_fraction, device)
    return plan


def context_bytes(device: torch.device) -> int:
    """Device memory in use outside torch's allocator: the device's used bytes (what
    `nvidia-smi` shows, every process on it) less what this process's allocator reserved. On a
    device shared with another process this counts that process too, which the budget must
    leave room for all the same."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total - free) - int(torch.cuda.memory_reserved(device)))


def planned_config(config: ServerConfig, plan: DeviceMemoryPlan | None) -> ServerConfig:
    """The settings the server runs with: the plan's L1 and page pool where none were given."""
    if plan is None:
        return config
    return dataclasses.replace(config, l1_bytes=plan.l1_bytes, batch_kv_bytes=plan.pool)


def decode_graphs(config: ServerConfig) -> bool:
    """Whether the step records decode-only graphs too (`decode_graphs`, on by default): one
    answer for the scheduler's capture and this plan's measurement of it."""
    return config.decode_graphs


def profile_graphs(
    model: Any, geometry: Any, dtype: torch.dtype, config: ServerConfig, max_seq_len: int
) -> tuple[int, int]:
    """(graphs, eager): the bytes the batched step's CUDA graphs keep (every bucket captured
    into its one pool, with the runner's fixed buffers), and the peak of an eager step at the
    largest bucket over them, measured by capturing the step once over a pool of two pages and
    freeing it all again. The model's attention implementation is put back."""
    import gc

    from kvtier.paged import BatchRunner, PagePool

    device = next(model.parameters()).device
    previous = model.config._attn_implementation  # noqa: SLF001  # transformers' field, no public getter
    size = page_size(device, dtype)
    max_batch = int(config.max_concurrency)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(device)
    pool = PagePool(
        geometry, 2 * size * geometry.bytes_per_token, page_size=size, device=device, dtype=dtype
    )
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    try:
        runner = BatchRunner(
            model,
            pool,
            max_batch=max_batch,
            max_tokens=max(int(config.batch_tokens), max_batch),
            max_seq_len=max_seq_len,
        )
        runner.capture_graphs(decode_graphs=decode_graphs(config))
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # what the side stream's eager passes cached goes back
        graphs = torch.cuda.memory_reserved(device) - base - pool.num_pages * pool.page_bytes
        # the first bucket's eager passes ran before any graph held memory
        eager = max(0, torch.cuda.max_memory_allocated(device) - start - graphs)
        del runner
    finally:
        del pool
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        model.set_attn_implementation(previous)
    return max(0, int(graphs)), int(eager)


def take_peak(device: torch.device) -> int:
    """The most bytes torch's allocator held on `device` since the last call (then reset)."""
    torch.cuda.synchronize(device)
    peak = int(torch.cuda.max_memory_reserved(device))
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def backend_device_bytes(backend: Any) -> dict[str, int]:
    """The cache's device parts as built (staging buffers, L1 claimed), to record beside the
    plan's figures; empty for a backend without a cache."""
    cache = getattr(backend, "cache", None)
    if cache is None:
        return {}
    staging = int(cache.engine.staging_bytes)
    return {"staging": staging, "l1": int(cache.l1.reserved_bytes())}


def startup_peaks(engine: Any) -> str:
    """The start-up phases' peaks, in words, against the budget."""
    plan = engine.plan
    return ", ".join(
        f"{phase} {_fmt(peak)} ({peak / plan.budget_bytes:.0%})"
        for phase, peak in engine.peaks.items()
    )


def weights_estimate(config: dict[str, Any], element: int) -> int:
    """The weights' bytes of a model config (a config.json's dict): its parameters counted on
    the meta device (no memory), at `element` bytes each."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        cfg = AutoConfig.for_model(str(config.get("model_type", "llama")), **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"cannot build the model of this config to count its weights: {exc}"
        ) from exc
    return sum(p.numel() for p in model.parameters()) * element


def _int(config: dict[str, Any], name: str, default: int) -> int:
    value = config.get(name)
    return int(value) if isinstance(value, (int, float)) else default


def offline_plan(
    config: dict[str, Any],
    geometry: Any,
    total_bytes: int,
    utilization: float,
    max_concurrency: int,
    batch_tokens: int,
    prefill_step: int,
    chunk_tokens: int,
    context_tokens: int | None = None,
) -> DeviceMemoryPlan:
    """The plan `build_plan` would make on a device of `total_bytes`, from the config alone:
    the weights counted, the activations and graphs estimated (`kvtier plan`)."""
    element = geometry.element_size
    hidden = _int(config, "hidden_size", 4096)
    intermediate = _int(config, "intermediate_size", 4 * hidden)
    vocab = _int(config, "vocab_size", 32000)
    batch_tokens = max(batch_tokens, max_concurrency)
    batch = activation_estimate(hidden, intermediate, vocab, batch_tokens, max_concurrency, element)
    step = activation_estimate(hidden, intermediate, vocab, prefill_step, prefill_step, element)
    context_tokens = context_tokens or _int(config, "max_position_embeddings", 4096)
    heads = _int(config, "num_attention_heads", geometry.num_kv_heads)
    attention = attention_estimate(geometry, heads, context_tokens, batch_tokens)
    return plan_memory(
        device="cuda",
        total_bytes=total_bytes,
        utilization=utilization,
        weights=weights_estimate(config, element),
        activations=max(batch, step) + attention,
        graphs=graph_estimate(batch, max_concurrency, vocab, element),
        staging=staging_estimate(geometry.chunk_bytes(chunk_tokens)),
        per_token=geometry.bytes_per_token,
        context_tokens=context_tokens,
    )


# ---- the page pool without a plan (the CPU; a model across devices) ----------------------


def pool_bytes(served: Any, config: ServerConfig, per_token: int) -> int:
    """The page pool's byte budget: `batch_kv_bytes`, or room for `max_concurrency` full contexts
    (at most half the free GPU memory on CUDA, 1 GiB on the CPU)."""
    given = int(config.batch_kv_bytes or 0)
    if given:
        return given
    want = int(config.max_concurrency) * int(served.context_tokens) * per_token
    device = served.device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(per_token * VARLEN_PAGE, min(want, free // 2))
    return min(want, _CPU_POOL_CAP)


def page_size(device: torch.device, dtype: torch.dtype) -> int:
    """Pages of 256 tokens where torch's varlen FlashAttention can read them (CUDA, fp16/bf16):
    it then runs steps that mix prompt chunks and decode tokens in one call; else 16."""
    flash = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    return VARLEN_PAGE if flash and varlen_block_table_supported() else PAGE_SIZE
