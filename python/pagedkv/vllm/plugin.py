"""Putting pagedkv's manager where vLLM builds its own.

vLLM's scheduler binds ``KVCacheManager`` from ``vllm.v1.core.kv_cache_manager``
at import time, so both that module and every loaded module that imported the
name are patched. vLLM calls ``register()`` (the ``vllm.general_plugins`` entry
point ``pagedkv``) in every process before it builds a scheduler; it installs
only when ``PAGEDKV_VLLM=1``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_ORIGINAL: dict[str, Any] = {}

# Modules that bind the name ``KVCacheManager`` from vLLM's manager module.
_BINDERS = (
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.sched.scheduler",
)


def install() -> None:
    """Makes vLLM build ``pagedkv.vllm.KVCacheManager`` in place of its own.

    Idempotent; ``uninstall()`` restores vLLM's class. Raises ``ImportError``
    when vLLM is not installed.
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
    original = _ORIGINAL.setdefault("cls", vllm_manager.KVCacheManager)
    if original is KVCacheManager:  # pragma: no cover - installed twice by hand
        return
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("vllm") and (
            getattr(mod, "KVCacheManager", None) is original
        ):
            setattr(mod, "KVCacheManager", KVCacheManager)  # noqa: B010


def uninstall() -> None:
    """Restores vLLM's own manager class where ``install()`` replaced it."""
    from pagedkv.vllm.manager import KVCacheManager

    original = _ORIGINAL.pop("cls", None)
    if original is None:
        return
    for mod in list(sys.modules.values()):
        if getattr(mod, "KVCacheManager", None) is KVCacheManager and getattr(
            mod, "__name__", ""
        ).startswith("vllm"):
            setattr(mod, "KVCacheManager", original)  # noqa: B010


def installed() -> bool:
    """Whether vLLM currently builds pagedkv's manager."""
    mod = sys.modules.get("vllm.v1.core.kv_cache_manager")
    if mod is None:
        return False
    from pagedkv.vllm.manager import KVCacheManager

    return mod.KVCacheManager is KVCacheManager


def register() -> None:
    """vLLM general-plugin hook: installs when ``PAGEDKV_VLLM=1``."""
    if os.environ.get("PAGEDKV_VLLM", "0") == "1":
        install()
