"""Putting pagedkv's manager (and CPU offloading manager) where vLLM builds its own.

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
from typing import Any, NamedTuple

_ORIGINAL: dict[str, Any] = {}


class _Target(NamedTuple):
    """One vLLM class pagedkv replaces."""

    #: the class's name where vLLM defines it
    name: str
    #: the module defining it
    home: str
    #: modules imported at install that bind the name too
    binders: tuple[str, ...]
    #: pagedkv's module holding the replacement (same name)
    ours: str


_TARGETS = (
    _Target(
        "KVCacheManager",
        "vllm.v1.core.kv_cache_manager",
        ("vllm.v1.core.sched.scheduler",),
        "pagedkv.vllm.manager",
    ),
    # behind the OffloadingConnector's CPU spec and the tiering manager
    _Target("CPUOffloadingManager", "vllm.v1.kv_offload.cpu.manager", (), "pagedkv.vllm.offload"),
    # the CPU tier of SimpleCPUOffloadScheduler
    _Target(
        "get_kv_cache_coordinator",
        "vllm.v1.core.kv_cache_coordinator",
        ("vllm.v1.simple_kv_offload.manager",),
        "pagedkv.vllm.coordinator",
    ),
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
        elif not key.startswith("pagedkv."):  # pagedkv keeps vLLM's classes on purpose
            others += [f"{key}.{n}" for n in names]
    return ours, others


def _replacement(target: _Target) -> type:
    import importlib

    cls: type = getattr(importlib.import_module(target.ours), target.name)
    return cls


def install() -> None:
    """Makes vLLM build pagedkv's classes in place of its own:
    ``pagedkv.vllm.KVCacheManager`` for its KV-cache manager and
    ``pagedkv.vllm.offload.CPUOffloadingManager`` for the CPU offloading
    manager (LRU and ARC) of its ``OffloadingConnector``.

    Every vLLM module that bound vLLM's class, under any name, gets pagedkv's;
    modules imported later find it where vLLM defines it. A module outside
    vLLM that imported vLLM's class before this call keeps it (it may hold it
    on purpose, to compare the two): a ``RuntimeWarning`` names each such
    binding. Idempotent; all or nothing; ``uninstall()`` restores vLLM's
    classes. Raises ``ImportError`` when vLLM is not installed.
    """
    import importlib

    try:
        importlib.import_module("vllm")
    except ImportError as e:
        raise ImportError(
            "pagedkv.vllm.install() needs vLLM 0.33 (pip install 'pagedkv[vllm]')"
        ) from e
    done: list[tuple[Any, str, type]] = []
    others: list[str] = []
    originals: dict[str, type] = {}
    try:
        for target in _TARGETS:
            with warnings.catch_warnings():
                # vLLM's own modules warn about their dependencies as they load
                warnings.simplefilter("ignore", DeprecationWarning)
                for name in (target.home, *target.binders):
                    importlib.import_module(name)
                ours = _replacement(target)
            home = sys.modules[target.home]
            original = _ORIGINAL.get(target.name, vars(home)[target.name])
            if original is ours:  # pragma: no cover - installed twice by hand
                continue
            bound, elsewhere = _bindings(original)
            for mod, name in bound:
                setattr(mod, name, ours)
                done.append((mod, name, original))
            originals[target.name] = original
            others += elsewhere
    except BaseException:
        for mod, name, original in done:
            setattr(mod, name, original)
        raise
    _ORIGINAL.update(originals)
    if others:
        warnings.warn(
            "pagedkv.vllm.install(): imported before install(), these keep vLLM's own "
            f"classes: {', '.join(sorted(others))}",
            RuntimeWarning,
            stacklevel=2,
        )


def uninstall() -> None:
    """Restores vLLM's own classes wherever a vLLM module holds pagedkv's
    (what ``install()`` replaced, and modules imported since)."""
    for target in _TARGETS:
        original = _ORIGINAL.pop(target.name, None)
        if original is None:
            continue
        for mod, name in _bindings(_replacement(target))[0]:
            setattr(mod, name, original)


def installed() -> bool:
    """Whether vLLM currently builds pagedkv's manager (and offloading manager)."""
    for target in _TARGETS:
        mod = sys.modules.get(target.home)
        if mod is None or vars(mod).get(target.name) is not _replacement(target):
            return False
    return True


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
