"""Every difference between the SGLang releases the plugin supports, in one place.

The plugin hooks SGLang's private interfaces, which change between releases. The oldest and the newest
supported release (:data:`SUPPORTED_SGLANG`) are both tested on CPU; the rest of the code imports what
differs from here instead of branching on the version itself. Each difference is chosen by feature
detection on the installed SGLang (the first branch is 0.5.17's, the second 0.5.23's):

- **Server-argument defaults hook.** 0.5.17: ``ServerArgs._handle_attention_backend_compatibility``;
  0.5.23 moved the step to ``sglang.srt.arg_groups.attention_hook.handle_attention_backend_compatibility``
  (same call, ``server_args`` as its one argument): :func:`attention_defaults_target`. 0.5.23 runs it
  when the launcher resolves the arguments (``ServerArgs.resolve_once``), after ``prepare_server_args``
  has returned: :func:`settings_error_targets`. There the arguments are read through a resolving view
  and written by declarations, not assigned: :class:`ServerArgsResolution`.
- **Hierarchical cache.** 0.5.17 has ``HiRadixCache`` (``mem_cache/hiradix_cache.py``), which the
  compressed host tier subclasses; 0.5.23 removed it (HiCache is attached to ``UnifiedRadixCache`` by
  ``init_hicache``), and the compressed host tier is not ported to that: :func:`hierarchical_cache_problem`,
  :func:`hiradix_cache_class`.
- **Tree events.** 0.5.17's ``RadixCache`` records KV events through its own methods
  (``_record_store_event(node, medium)``, ``_record_remove_event(node, medium)``); 0.5.23's through a
  recorder object (``tree.kv_events.record_store`` / ``record_remove``): :func:`watch_stored_nodes`,
  :func:`record_remove_event`.
- **Match results.** 0.5.17's ``MatchResult.device_indices`` (the matched prefix's KV slots); 0.5.23
  returns ``device_prefix_len`` and the tree gives the slots from the last node
  (``path_device_indices``): :func:`match_device_indices`.
- **Requests entering the tree.** 0.5.17 inserts a finished request with ``cache_finished_req`` (and a
  chunk of a running one with ``cache_unfinished_req``); 0.5.23 inserts both with ``checkpoint(req,
  up_to=...)``: :func:`request_insert_method`, :func:`request_insert_mixin`.

Nothing here imports SGLang at module level: the plugin loads in every SGLang process, the launcher
included.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec

SUPPORTED_SGLANG = ("0.5.17", "0.5.23")
"""The oldest and the newest SGLang release the plugin is tested on (both inclusive)."""

_SERVER_ARGS_DEFAULTS_HOOK = "sglang.srt.server_args.ServerArgs._handle_attention_backend_compatibility"
_ARG_GROUPS_DEFAULTS_HOOK = "sglang.srt.arg_groups.attention_hook.handle_attention_backend_compatibility"
_HIRADIX_MODULE = "sglang.srt.mem_cache.hiradix_cache"


# --------------------------------------------------------------------------------------- version
def _release(text: str) -> tuple[int, ...] | None:
    """``"0.5.23"`` -> ``(0, 5, 23)``; None for a version that is not plain numbers (a dev build)."""
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        return None


def sglang_version() -> str:
    """The installed SGLang's version, or ``"not installed"``."""
    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


def version_problem(found: str) -> str | None:
    """None if SGLang ``found`` lies in the tested range, else one line saying what is allowed."""
    release, low, high = _release(found), _release(SUPPORTED_SGLANG[0]), _release(SUPPORTED_SGLANG[1])
    if release is not None and low <= release <= high:
        return None
    return (f"hierasparse: sglang {found} is not supported; allowed: sglang>={SUPPORTED_SGLANG[0]},"
            f"<={SUPPORTED_SGLANG[1]} (the plugin hooks private SGLang APIs; the range is the tested one)")


# --------------------------------------------------------------------------------------- server args
def attention_defaults_target() -> str:
    """The hook target (``HookRegistry`` path) of SGLang's attention-backend resolution step, after
    which the backend's server-argument defaults are applied; called with ``server_args``."""
    from sglang.srt.server_args import ServerArgs

    if hasattr(ServerArgs, "_handle_attention_backend_compatibility"):
        return _SERVER_ARGS_DEFAULTS_HOOK
    return _ARG_GROUPS_DEFAULTS_HOOK


def settings_error_targets() -> tuple[str, ...]:
    """The hook targets (``HookRegistry`` paths) inside which a launcher's settings are checked, so that a
    settings error there ends the launcher with one line: 0.5.17 parses and resolves the server arguments in
    ``prepare_server_args``; 0.5.23 parses there and resolves them later, in ``ServerArgs.resolve_once``."""
    from sglang.srt.server_args import ServerArgs

    targets = ("sglang.srt.server_args.prepare_server_args",)
    if hasattr(ServerArgs, "resolve_once"):
        targets += ("sglang.srt.server_args.ServerArgs.resolve_once",)
    return targets


class ServerArgsResolution:
    """Reads and writes of SGLang's server arguments inside the attention-backend resolution step.

    0.5.17's ``ServerArgs`` resolves in ``__post_init__`` by assigning its fields (so does any plain object
    in its place, as in the tests); 0.5.23's resolves in a pipeline (``ServerArgs.resolve_once``) that
    refuses assignment: it is read through ``resolving_view`` and written with ``declare_resolution``, and
    the model config comes from ``model_config_of``. Attribute reads give the value resolved so far."""

    SOURCE = "hierasparse"

    def __init__(self, server_args):
        object.__setattr__(self, "_args", server_args)
        object.__setattr__(self, "_pipeline", hasattr(type(server_args), "resolve_once"))
        if self._pipeline:
            from sglang.srt.arg_groups.model_override_base import resolving_view

            object.__setattr__(self, "_view", resolving_view(server_args))
        else:
            object.__setattr__(self, "_view", server_args)

    def __getattr__(self, name):
        return getattr(self._view, name)

    def __setattr__(self, name, value):
        raise AttributeError("server arguments are written with declare()")

    def declare(self, **fields) -> None:
        """Set resolved values of server-argument fields."""
        if self._pipeline:
            from sglang.srt.arg_groups.overrides import declare_resolution

            declare_resolution(self._args, self.SOURCE, **fields)
        else:
            for name, value in fields.items():
                setattr(self._args, name, value)

    def declare_cuda_graph_backend(self, phase: str, backend) -> None:
        """The CUDA-graph backend of ``phase`` (``"prefill"`` or ``"decode"``)."""
        if self._pipeline:
            from sglang.srt.model_executor.cuda_graph_config import with_phase

            self.declare(cuda_graph_config=with_phase(self._view.cuda_graph_config, phase, backend=backend))
        else:
            getattr(self._args.cuda_graph_config, phase).backend = backend

    def model_config(self):
        """SGLang's ``ModelConfig`` of the served model."""
        if self._pipeline:
            from sglang.srt.arg_groups.model_override_base import model_config_of

            return model_config_of(self._args)
        return self._args.get_model_config()


# --------------------------------------------------------------------------------------- hierarchical cache
def has_hiradix_cache() -> bool:
    """Whether the installed SGLang has ``HiRadixCache``, the tree the compressed host tier extends."""
    return find_spec(_HIRADIX_MODULE) is not None


def hierarchical_cache_problem() -> str | None:
    """None if ``--enable-hierarchical-cache`` can run with hierasparse here, else why not (one line)."""
    if has_hiradix_cache():
        return None
    return (f"hierasparse: --enable-hierarchical-cache needs SGLang's HiRadixCache, which sglang {sglang_version()} "
            f"no longer has (HiCache moved onto UnifiedRadixCache); the compressed host tier runs on sglang "
            f"{SUPPORTED_SGLANG[0]}; allowed: unset")


def hiradix_cache_class() -> type:
    """SGLang's ``HiRadixCache`` class (ImportError with :func:`hierarchical_cache_problem`'s line when
    the installed SGLang has none)."""
    if not has_hiradix_cache():
        raise ImportError(hierarchical_cache_problem())
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    return HiRadixCache


# --------------------------------------------------------------------------------------- tree events
class _StoreWatchingRecorder:
    """SGLang's KV-event recorder (0.5.23), plus a call to ``on_stored(node, medium)`` after each
    node it records as stored; everything else goes to the recorder unchanged."""

    def __init__(self, recorder, on_stored):
        self._recorder, self._on_stored = recorder, on_stored

    def record_store(self, node, medium=None, **kwargs):
        result = self._recorder.record_store(node, medium, **kwargs)
        self._on_stored(node, medium)
        return result

    def __getattr__(self, name):
        return getattr(self._recorder, name)


def watch_stored_nodes(tree, on_stored) -> None:
    """Call ``on_stored(node, medium)`` after SGLang records a node entering ``tree`` (``medium`` None
    for a node the GPU tier took from a request, a ``StorageMedium`` for the host tier's events)."""
    recorder = getattr(tree, "kv_events", None)
    if recorder is not None and hasattr(recorder, "record_store"):
        tree.kv_events = _StoreWatchingRecorder(recorder, on_stored)
        return
    record = tree._record_store_event  # SGLang's own method, bound before it is shadowed

    def record_and_watch(node, medium=None):
        record(node, medium)
        on_stored(node, medium)

    tree._record_store_event = record_and_watch


def record_remove_event(tree, node, medium=None) -> None:
    """Record ``node`` leaving ``tree`` (on ``medium``, default the GPU) as SGLang's own eviction does."""
    recorder = getattr(tree, "kv_events", None)
    if recorder is not None and hasattr(recorder, "record_remove"):
        recorder.record_remove(node, medium)
    else:
        tree._record_remove_event(node, medium=medium)


# --------------------------------------------------------------------------------------- matches
def match_device_indices(tree, result):
    """The KV slots of a ``match_prefix`` result's prefix on the device (int64 tensor)."""
    indices = getattr(result, "device_indices", None)
    if indices is not None:
        return indices
    return tree.path_device_indices(result.last_device_node)


# --------------------------------------------------------------------------------------- requests
class _FinishedRequestInsert:
    """0.5.17: a finished request's tokens enter the tree through ``cache_finished_req``."""

    def cache_finished_req(self, req, is_insert: bool = True, **kwargs):
        with self.inserting_request(req):
            return super().cache_finished_req(req, is_insert, **kwargs)


class _CheckpointInsert:
    """0.5.23: a request's tokens enter the tree through ``checkpoint`` (running or finished)."""

    def checkpoint(self, req, *, up_to: int, **kwargs):
        with self.inserting_request(req):
            return super().checkpoint(req, up_to=up_to, **kwargs)


def request_insert_method() -> str:
    """The ``RadixCache`` method through which SGLang inserts a finished request's tokens."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return "checkpoint" if hasattr(RadixCache, "checkpoint") else "cache_finished_req"


def request_insert_mixin() -> type:
    """A mixin (before ``RadixCache`` in the bases) that wraps :func:`request_insert_method` in
    ``self.inserting_request(req)``, a context manager the tree defines (the radix hook: blocks before
    the request's prompt length are prompt blocks)."""
    return _CheckpointInsert if request_insert_method() == "checkpoint" else _FinishedRequestInsert

