"""Putting pagedkv's manager where vLLM builds its own.

vLLM's scheduler binds ``KVCacheManager`` from ``vllm.v1.core.kv_cache_manager``
at import time, so both that module and every loaded module that imported the
name are patched. vLLM calls ``register()`` (the ``vllm.general_plugins`` entry
point ``pagedkv``) in every process before it builds a scheduler; it installs
only when ``PAGEDKV_VLLM`` is ``1``, ``true``, ``yes`` or ``on``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

_ORIGINAL: dict[str, Any] = {}

# Modules that bind the name ``KVCacheManager`` from vLLM's manager module.
_BINDERS = (
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.sched.scheduler",
)


def _bindings(cls: type) -> tuple[list[tuple[Any, str]], list[str]]:
    """Where ``cls`` is bound at module level: ``(module, name)`` in vLLM's
    modules, and ``module.name`` elsewhere. Module namespaces are read
    directly, so a module's ``__getattr__`` never runs (it may raise)."""
    ours, others = [], []
    for key, mod in list(sys.modules.items()):
        try:
            namespace = vars(mod)
        except TypeError:  # not a module (a placeholder some loaders leave)
            continue
        names = [n for n, v in list(namespace.items()) if v is cls]
        if not names:
            continue
        if key == "vllm" or key.startswith("vllm."):
            ours += [(mod, n) for n in names]
        else:
            others += [f"{key}.{n}" for n in names]
    return ours, others


def install() -> None:
    """Makes vLLM build ``pagedkv.vllm.KVCacheManager`` in place of its own.

    Every vLLM module that bound vLLM's class, under any name, gets pagedkv's;
    modules imported later find it in ``vllm.v1.core.kv_cache_manager``. A
    module outside vLLM that imported vLLM's class before this call keeps it
    (it may hold it on purpose, to compare the two): a ``RuntimeWarning``
    names each such binding. Idempotent; all or nothing; ``uninstall()``
    restores vLLM's class. Raises ``ImportError`` when vLLM is not installed.
    """
    import importlib

    try:
        importlib.import_module("vllm")
    except ImportError as e:
        raise ImportError(
            "pagedkv.vllm.install() needs vLLM 0.33 (pip install 'pagedkv[vllm]')"
        ) from e
    from pagedkv.vllm.manager import KVCacheManager

    for name in _BINDERS:
        importlib.import_module(name)
    vllm_manager = sys.modules["vllm.v1.core.kv_cache_manager"]
    original = _ORIGINAL.get("cls", vars(vllm_manager)["KVCacheManager"])
    if original is KVCacheManager:  # pragma: no cover - installed twice by hand
        return
    ours, others = _bindings(original)
    done: list[tuple[Any, str]] = []
    try:
        for mod, name in ours:
            setattr(mod, name, KVCacheManager)
            done.append((mod, name))
    except BaseException:
        for mod, name in done:
            setattr(mod, name, original)
        raise
    _ORIGINAL["cls"] = original
    if others:
        import warnings

        warnings.warn(
            "pagedkv.vllm.install(): imported before install(), these keep vLLM's own "
            f"KVCacheManager: {', '.join(sorted(others))}",
            RuntimeWarning,
            stacklevel=2,
        )


def uninstall() -> None:
    """Restores vLLM's own manager class wherever a vLLM module holds
    pagedkv's (what ``install()`` replaced, and modules imported since)."""
    original = _ORIGINAL.get("cls")
    if original is None:
        return
    from pagedkv.vllm.manager import KVCacheManager

    for mod, name in _bindings(KVCacheManager)[0]:
        setattr(mod, name, original)
    del _ORIGINAL["cls"]


def installed() -> bool:
    """Whether vLLM currently builds pagedkv's manager."""
    mod = sys.modules.get("vllm.v1.core.kv_cache_manager")
    if mod is None:
        return False
    from pagedkv.vllm.manager import KVCacheManager

    return vars(mod).get("KVCacheManager") is KVCacheManager


#: ``PAGEDKV_VLLM`` values (case-insensitive) that install, and that do not.
TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("", "0", "false", "no", "off")


def enabled(value: str | None) -> bool:
    """Whether a ``PAGEDKV_VLLM`` value asks for pagedkv's manager: ``1``,
    ``true``, ``yes``, ``on`` (any case, spaces around ignored) do; unset, empty,
    ``0``, ``false``, ``no``, ``off`` do not; any other value does not and warns."""
    if value is None:
        return False
    v = value.strip().lower()
    if v in TRUE_VALUES:
        return True
    if v not in FALSE_VALUES:
        warnings.warn(
            f"PAGEDKV_VLLM={value!r} is not understood (1/true/yes/on or "
            "0/false/no/off): vLLM keeps its own KV-cache manager",
            RuntimeWarning,
            stacklevel=2,
        )
    return False


def register() -> None:
    """vLLM general-plugin hook: installs when ``PAGEDKV_VLLM`` is ``1``,
    ``true``, ``yes`` or ``on`` (see :func:`enabled`)."""
    if enabled(os.environ.get("PAGEDKV_VLLM")):
        install()
