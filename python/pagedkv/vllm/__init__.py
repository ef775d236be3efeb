"""pagedkv behind vLLM 0.33's own scheduler.

``pagedkv.vllm.KVCacheManager`` takes vLLM 0.33's constructor and answers its
calls (vLLM ``Request`` objects in, ``KVCacheBlocks``, ``PrefixCacheStats`` and
KV events out) from pagedkv's core. ``install()`` makes vLLM build it wherever
it builds its own manager; with the ``pagedkv`` general plugin registered (the
package's ``vllm.general_plugins`` entry point), ``PAGEDKV_VLLM=1 vllm serve
MODEL`` does the same. Importing this module imports vLLM (``pagedkv[vllm]``).
"""

from pagedkv.vllm.manager import KVCacheManager
from pagedkv.vllm.plugin import install, installed, uninstall

__all__ = ["KVCacheManager", "install", "installed", "uninstall"]
