"""HieraSparse settings: one frozen dataclass, parsed from CLI flags or one environment variable.

The launcher validates the settings and exports them as JSON in ``SGLANG_HIERASPARSE_CONFIG`` so that
SGLang's scheduler processes (started with multiprocessing "spawn") read exactly what the launcher
checked. Every check raises :class:`HieraSparseConfigError` with a one-line message that names the
setting and the allowed values.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

ENV_VAR = "SGLANG_HIERASPARSE_CONFIG"
BACKEND_NAME = "hierasparse"
"""The ``--attention-backend`` (and ``--radix-cache-backend``) name the plugin registers."""

# Values the TileLang kernels are built for. The PyTorch reference takes any multiple of 16, but a
# server must not start with settings its kernels cannot run.
SUPPORTED_BLOCK_SIZES = (64,)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = ("float16", "bfloat16")
DENSE_BACKENDS = ("flashinfer", "triton")
# Values of the compressed store: the model's dtype, or FP8 e4m3 with a scale per pool row.
STORE_DTYPES = ("auto", "fp8_e4m3")
# Kernels that take FP8 KV (an FP8 store, SGLang's FP8 pages): decode reads e4m3 in the kernel (its
# store_fp8 / cache_fp8 variants), extend reads 16-bit copies of a batch's blocks; the compress kernel
# reads and writes 16-bit blocks only (the PyTorch compressor quantizes).
FP8_KERNELS = ("decode", "extend")
# TileLang kernels the backend can use; each one left out runs on the PyTorch path instead.
KERNELS = ("decode", "extend", "compress")
# Query heads per KV head (on one tensor-parallel rank) that the decode and extend kernels' GPU tests
# cover: every group up to 8 (decode pads the group to 8 columns, extend leaves the last N - (N // G) * G
# columns of a tile idle).
KERNEL_GQA_GROUPS = tuple(range(1, 9))
# wgmma.sp (sparse tensor cores with Hopper's warpgroup MMA) needs compute capability 9.0.
REQUIRED_COMPUTE_CAPABILITY = (9, 0)


class HieraSparseConfigError(ValueError):
    """A setting is out of range; the message is one line naming the setting and what is allowed."""


@dataclass(frozen=True)
class HieraSparseConfig:
    """User-facing settings of the HieraSparse backend (see the README's settings table)."""

    block_size: int = 64
    """Tokens per compressed block. Tied to SGLang's --page-size: one block is one KV page."""
    sink_tokens: int = 64
    """Leading tokens of every sequence that always stay dense (attention sinks)."""
    window_tokens: int = 256
    """Trailing tokens of a cached prefix that stay dense (a later request's local window)."""
    sk_prefill: float = 0.0
    """Fraction of prompt-token blocks whose K is stored 2:4 sparse."""
    sv_prefill: float = 1.0
    """Fraction of prompt-token blocks whose V is stored 2:4 sparse."""
    sk_decode: float = 0.0
    """Fraction of generated-token blocks (cached at request finish) whose K is stored sparse."""
    sv_decode: float = 1.0
    """Fraction of generated-token blocks whose V is stored sparse."""
    pruner: str = "magnitude"
    """Name of the pruner that picks element masks and ranks blocks (see sglang_hs.pruner)."""
    store_fraction: float = 0.5
    """Share of SGLang's KV-cache memory budget given to the compressed store; the rest stays dense."""
    host_store_fraction: float = 0.9
    """With --enable-hierarchical-cache: share of the host tier's bytes given to compressed blocks; the
    rest is SGLang's dense host pool (sinks, windows, requests' own tokens). An 8K prefix keeps 320 of
    its tokens dense: 5% of its host bytes at S_V = 1."""
    dense_backend: str = "flashinfer"
    """SGLang backend that attends over the dense tokens (new tokens, sink, window)."""
    kernels: str = "decode,extend,compress"
    """TileLang kernels to use (comma list); ``none`` runs every compressed path in PyTorch."""
    store_dtype: str = "auto"
    """Values of the compressed blocks: ``auto`` (the model's dtype) or ``fp8_e4m3`` (half the bytes; a
    float32 scale per block, KV head and layer, computed by the compressor after pruning)."""
    k_channel_order: str = ""
    """File of a calibrated permutation of head_dim per (layer, KV head) applied to q and k (see
    ``sglang_hs.channel_order``), so that 2:4 K drops fewer large channels; empty: natural order."""
    k_head_map: str = ""
    """File of a K head map (see ``sglang_hs.k_head_map``): in a K-sparse block only the mapped (layer,
    KV head) pairs store K 2:4, the heads that retrieve keep it dense; empty: every head."""
    shared_prefix_decode: str = "off"
    """``on``: decode batches whose requests share leading blocks read them once per group of requests
    (``sglang_hs.kernels.decode_shared``); needs the decode kernel. ``off``: every request reads its
    own blocks."""
    decode_mode: str = "full"
    """``full`` reads every block at decode; ``kascade`` / ``psa`` read, between anchor layers, only the
    compressed blocks an anchor layer's attention chose (``sglang_hs.decode_modes``)."""
    decode_anchors: str = ""
    """Comma list of the decode modes' anchor layers (from 0); empty: every 4th layer."""
    decode_topk: int = 64
    """Compressed blocks a request reads between anchors (``kascade``), or at most (``psa``)."""
    decode_tau: float = 0.9
    """``psa``: the share of the anchor's attention mass on compressed blocks that the chosen ones reach."""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every setting that does not depend on the model or the GPU."""
        from sglang_hs.pruner import PRUNERS  # local: the pruner module imports torch

        _require(
            self.block_size in SUPPORTED_BLOCK_SIZES,
            cli_flag("block_size"),
            self.block_size,
            f"one of {list(SUPPORTED_BLOCK_SIZES)}",
        )
        for name in ("sink_tokens", "window_tokens"):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and value >= 0 and value % self.block_size == 0,
                cli_flag(name),
                value,
                f"a non-negative multiple of block_size ({self.block_size})",
            )
        for name in ("sk_prefill", "sv_prefill", "sk_decode", "sv_decode"):
            value = getattr(self, name)
            _require(0.0 <= value <= 1.0, cli_flag(name), value, "a fraction in [0, 1]")
        _require(self.pruner in PRUNERS, cli_flag("pruner"), self.pruner, f"one of {sorted(PRUNERS)}")
        _require(
            0.0 < self.store_fraction <= 0.95,
            cli_flag("store_fraction"),
            self.store_fraction,
            "a fraction in (0, 0.95]",
        )
        _require(
            0.0 < self.host_store_fraction <= 0.95,
            cli_flag("host_store_fraction"),
            self.host_store_fraction,
            "a fraction in (0, 0.95]",
        )
        _require(
            self.dense_backend in DENSE_BACKENDS,
            cli_flag("dense_backend"),
            self.dense_backend,
            f"one of {list(DENSE_BACKENDS)}",
        )
        _require(
            not self.k_channel_order or os.path.isfile(self.k_channel_order),
            cli_flag("k_channel_order"),
            self.k_channel_order,
            "a file written by python -m sglang_hs.launch.calibrate_channels",
        )
        _require(
            not self.k_head_map or os.path.isfile(self.k_head_map),
            cli_flag("k_head_map"),
            self.k_head_map,
            "a file written by python -m sglang_hs.launch.calibrate_heads",
        )
        _require(self.shared_prefix_decode in ("off", "on"), cli_flag("shared_prefix_decode"),
                 self.shared_prefix_decode, "'off' or 'on'")  # fmt: skip
        from sglang_hs.decode_modes import MODES

        _require(self.decode_mode in MODES, cli_flag("decode_mode"), self.decode_mode, f"one of {list(MODES)}")
        _require(self.decode_mode == "full" or self.shared_prefix_decode == "off", cli_flag("decode_mode"),
                 self.decode_mode, "'full' with --hierasparse-shared-prefix-decode on")  # fmt: skip
        self._check_anchors(None)  # the syntax now; the model's layer count in validate_model
        _require(self.decode_topk >= 1, cli_flag("decode_topk"), self.decode_topk, "an integer >= 1")
        _require(0.0 < self.decode_tau <= 1.0, cli_flag("decode_tau"), self.decode_tau, "a fraction in (0, 1]")
        names = self.kernels.split(",")
        _require(
            self.kernels == "none" or (len(set(names)) == len(names) and set(names) <= set(KERNELS)),
            cli_flag("kernels"),
            self.kernels,
            f"'none' or a comma list of distinct names from {list(KERNELS)}",
        )
        _require(self.shared_prefix_decode == "off" or self.uses_kernel("decode"), cli_flag("shared_prefix_decode"),
                 self.shared_prefix_decode, "'off' unless --hierasparse-kernels includes decode")  # fmt: skip
        _require(self.store_dtype in STORE_DTYPES, cli_flag("store_dtype"), self.store_dtype, f"one of {list(STORE_DTYPES)}")
        _require(self.store_dtype == "auto" or self.fp8_kernels_only(), cli_flag("kernels"), self.kernels,
                 f"'none' or a comma list from {list(FP8_KERNELS)} with --hierasparse-store-dtype={self.store_dtype}")  # fmt: skip
        _require(self.store_dtype == "auto" or self.shared_prefix_decode == "off", cli_flag("shared_prefix_decode"),
                 self.shared_prefix_decode, f"'off' with --hierasparse-store-dtype={self.store_dtype}")  # fmt: skip

    def _check_anchors(self, num_layers: int | None) -> None:
        """``--hierasparse-decode-anchors`` parses (and, given ``num_layers``, fits the model)."""
        from sglang_hs.decode_modes import parse_anchors

        try:
            parse_anchors(self.decode_anchors, num_layers)
        except ValueError as exc:
            raise HieraSparseConfigError(str(exc)) from None

    @property
    def store_value_dtype(self):
        """The torch dtype of FP8 store values, or None for the model's dtype (``store_dtype`` auto)."""
        if self.store_dtype == "auto":
            return None
        import torch  # local: this module is read before torch loads (launcher flags)

        return torch.float8_e4m3fn

    def fp8_kernels_only(self) -> bool:
        """Every enabled kernel takes FP8 KV (:data:`FP8_KERNELS`)."""
        return self.kernels == "none" or set(self.kernels.split(",")) <= set(FP8_KERNELS)

    def uses_kernel(self, name: str) -> bool:
        """Whether the TileLang kernel ``name`` (one of ``KERNELS``) is enabled by the settings."""
        return name in self.kernels.split(",")

    def validate_model(self, head_dim: int, dtype: str, kv_cache_dtype: str, gqa_group: int,
                       num_layers: int | None = None) -> None:  # fmt: skip
        """Check the model shape (``gqa_group``: query heads per KV head on one rank; ``num_layers`` for
        the decode modes' anchors) and the cache dtype against what the kernels support."""
        if num_layers is not None and self.decode_mode != "full":
            self._check_anchors(num_layers)
        _require(
            gqa_group in KERNEL_GQA_GROUPS or not (self.uses_kernel("decode") or self.uses_kernel("extend")),
            cli_flag("kernels"),
            self.kernels,
            f"'compress' or 'none' for this model: its {gqa_group} query heads per KV head are not a GQA "
            f"group of the decode and extend kernels ({list(KERNEL_GQA_GROUPS)})",
        )
        # The kernels' tiles take head_dim 64 and 128; the PyTorch paths any multiple of 16 (2:4 metadata
        # words cover 16 channels), e.g. Phi-3's 96 or 256.
        _require(
            head_dim in SUPPORTED_HEAD_DIMS or (self.kernels == "none" and head_dim % 16 == 0),
            "the model's head_dim",
            head_dim,
            f"one of {list(SUPPORTED_HEAD_DIMS)}, or a multiple of 16 with --hierasparse-kernels none",
        )
        _require(dtype in SUPPORTED_DTYPES, "--dtype", dtype, f"one of {list(SUPPORTED_DTYPES)}")
        # SGLang's FP8 pages (unit scales): the PyTorch paths read them, and the decode and extend kernels
        # beside an FP8 store.
        _require(
            kv_cache_dtype in ("auto", dtype) or (kv_cache_dtype == "fp8_e4m3" and (
                self.kernels == "none" or (self.store_dtype == "fp8_e4m3" and self.fp8_kernels_only()))),
            "--kv-cache-dtype",
            kv_cache_dtype,
            f"'auto' or the model dtype '{dtype}', or 'fp8_e4m3' with --hierasparse-store-dtype fp8_e4m3 and "
            f"--hierasparse-kernels 'none' or a comma list from {list(FP8_KERNELS)}",
        )

    @staticmethod
    def validate_architecture(architecture: str, attention_arch: str, sliding_window: bool = False,
                              encoder_decoder: bool = False, chunked_attention: bool = False) -> None:  # fmt: skip
        """Refuse models whose attention is not the one KV pool of full causal MHA/GQA layers that the store,
        the radix hook and the kernels are built on: MLA's latent cache, sliding-window layers (the kernels
        read every cached block), chunked local attention, encoder-decoder cross attention."""
        allowed = "a model whose every layer has full causal multi-head or grouped-query attention (Llama, Qwen2, ...)"
        why = ("MLA attention" if attention_arch != "MHA" else
               "sliding-window attention" if sliding_window else
               "chunked local attention" if chunked_attention else
               "encoder-decoder attention" if encoder_decoder else None)  # fmt: skip
        if why is not None:
            raise HieraSparseConfigError(f"hierasparse: --model-path is a {architecture} with {why}; allowed: {allowed}")

    @staticmethod
    def validate_gpu(capability: tuple[int, int] | None, name: str = "") -> None:
        """Refuse GPUs without Hopper sparse tensor cores (wgmma.sp)."""
        wanted = "compute capability %d.%d (NVIDIA Hopper: H100/H200/H20)" % REQUIRED_COMPUTE_CAPABILITY
        if capability is None:
            raise HieraSparseConfigError(f"hierasparse: no CUDA GPU found; allowed: a GPU with {wanted}")
        if tuple(capability) != REQUIRED_COMPUTE_CAPABILITY:
            raise HieraSparseConfigError(
                f"hierasparse: GPU {name or '?'} has compute capability {capability[0]}.{capability[1]}; "
                f"allowed: {wanted}"
            )

    # ------------------------------------------------------------------ (de)serialization
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "HieraSparseConfig":
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise HieraSparseConfigError(
                f"hierasparse: unknown setting(s) {unknown}; allowed: {sorted(known)}"
            )
        converted = {}
        for key, value in values.items():
            field_type = field_parser(known[key])
            try:
                converted[key] = field_type(value)
            except (TypeError, ValueError):
                raise HieraSparseConfigError(
                    f"hierasparse: {key}={value!r} is not a valid {field_type.__name__}"
                ) from None
        return cls(**converted)

    @classmethod
    def from_env(cls) -> "HieraSparseConfig":
        """The settings the launcher exported, or the defaults when it exported none."""
        raw = os.environ.get(ENV_VAR)
        if not raw:
            return cls()
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise HieraSparseConfigError(f"hierasparse: {ENV_VAR} is not valid JSON ({exc.msg})") from None
        if not isinstance(values, dict):
            raise HieraSparseConfigError(f"hierasparse: {ENV_VAR} must be a JSON object")
        return cls.from_mapping(values)

    def export(self) -> None:
        """Publish these settings to child processes through the environment."""
        os.environ[ENV_VAR] = self.to_json()


def uses_backend(server_args) -> bool:
    """Whether SGLang's server arguments select the hierasparse attention backend for any phase."""
    names = (
        server_args.attention_backend,
        server_args.prefill_attention_backend,
        server_args.decode_attention_backend,
    )
    return BACKEND_NAME in names


def field_parser(field: dataclasses.Field) -> type:
    """The Python type that parses a setting's value (annotations are strings here)."""
    return {"int": int, "float": float, "str": str}[str(field.type)]


def cli_flag(field_name: str) -> str:
    """The command-line flag of a setting, e.g. sk_prefill -> --hierasparse-sk-prefill."""
    return "--hierasparse-" + field_name.replace("_", "-")


def _require(ok: bool, label: str, value: Any, allowed: str) -> None:
    if not ok:
        raise HieraSparseConfigError(f"hierasparse: {label}={value!r} is invalid; allowed: {allowed}")
