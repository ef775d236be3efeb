"""pagedkv behind vLLM 0.33's own scheduler.

``pagedkv.vllm.KVCacheManager`` takes vLLM 0.33's constructor and answers its
calls (vLLM ``Request`` objects in, ``KVCacheBlocks``, ``PrefixCacheStats`` and
KV events out) from pagedkv's core. ``install()`` makes vLLM build it wherever
it builds its own manager; with the ``pagedkv`` general plugin registered (the
package's ``vllm.general_plugins`` entry point), ``PAGEDKV_VLLM=1 vllm serve
MODEL`` does the same. ``KVCacheManager`` imports vLLM (``pagedkv[vllm]``) when
first used; the plugin functions import it only when they install.

``pagedkv.vllm.CPUOffloadingManager`` is vLLM's CPU offloading manager (LRU
and ARC, behind the ``OffloadingConnector``) on pagedkv's host tier;
``install()`` puts it in vLLM's place too.

``pagedkv.vllm.get_kv_cache_coordinator`` builds a coordinator (vLLM's
``get_kv_cache_coordinator``) over pagedkv's core: ``install()`` makes the
CPU tier of vLLM's ``SimpleCPUOffloadScheduler`` (its coordinator and block
pool) pagedkv's.
"""

from typing import TYPE_CHECKING, Any

from pagedkv.vllm.plugin import install, installed, register, uninstall

if TYPE_CHECKING:
    from pagedkv.vllm.coordinator import get_kv_cache_coordinator
    from pagedkv.vllm.manager import KVCacheManager
    from pagedkv.vllm.offload import CPUOffloadingManager

__all__ = [
    "CPUOffloadingManager",
    "KVCacheManager",
    "get_kv_cache_coordinator",
    "install",
    "installed",
    "register",
    "uninstall",
]

_LAZY = {
    "KVCacheManager": "pagedkv.vllm.manager",
    "CPUOffloadingManager": "pagedkv.vllm.offload",
    "get_kv_cache_coordinator": "pagedkv.vllm.coordinator",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as e:
            if e.name is None or e.name.split(".")[0] != "vllm":
                raise
            raise ImportError(
                f'pagedkv.vllm.{name} needs vLLM 0.33: pip install "pagedkv[vllm]" '
                f"(no module named {e.name!r})",
                name="vllm",
            ) from e
        return getattr(module, name)
    raise AttributeError(f"module 'pagedkv.vllm' has no attribute {name!r}")
