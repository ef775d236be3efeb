"""The harness's KV connector (scheduler role only), registered with vLLM by name.

It offers each request a number of external tokens the fake model decides;
the loads it records are reported back as the worker would (``drive``).
"""

from __future__ import annotations

import sys
from typing import Any

from .workload import FakeModel


def _connector_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )

    class DiffMetadata(KVConnectorMetadata):
        def __init__(self, req_ids: list[str]) -> None:
            self.req_ids = req_ids

    class DiffConnector(KVConnectorBase_V1):
        """Offers a per-request number of external tokens; the harness reports the loads."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            extra = self._kv_transfer_config.kv_connector_extra_config
            self.model: FakeModel = extra["model"]
            self.is_async: bool = extra["is_async"]
            self.offered: set[str] = set()
            self.matched: dict[str, tuple[int, int]] = {}
            #: (request id, external block ids) loaded since the harness last looked.
            self.loads: list[tuple[str, list[int]]] = []

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            rid = request.request_id
            if rid in self.offered:
                return 0, False
            n = self.model.external_tokens(rid, request.num_prompt_tokens, num_computed_tokens)
            self.matched[rid] = (num_computed_tokens, n)
            return n, self.is_async and n > 0

        def update_state_after_alloc(
            self, request: Any, blocks: Any, num_external_tokens: int
        ) -> None:
            rid = request.request_id
            if num_external_tokens <= 0:
                return
            self.offered.add(rid)
            start, _ = self.matched.get(rid, (0, 0))
            bs = self.model.case.block_size
            ids = blocks.get_block_ids()[0]
            self.loads.append((rid, list(ids[start // bs : (start + num_external_tokens) // bs])))

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return DiffMetadata([r.req_id for r in scheduler_output.scheduled_new_reqs])

        def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
            return False, None

        # Worker-side hooks: never called in the scheduler process.
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
        def wait_for_layer_load(self, layer_name: str) -> None: ...
        def save_kv_layer(self, *args: Any, **kwargs: Any) -> None: ...
        def wait_for_save(self) -> None: ...

    return DiffConnector


_CONNECTOR: dict[str, type] = {}


def register_connector() -> None:
    if _CONNECTOR:
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _CONNECTOR["cls"] = _connector_class()
    mod = sys.modules[__name__]
    mod.DiffConnector = _CONNECTOR["cls"]  # type: ignore[attr-defined]
    KVConnectorFactory.register_connector("PagedkvDiffConnector", __name__, "DiffConnector")
