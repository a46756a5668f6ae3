"""The test connector of ``test_vllm_tp_e2e`` (imported by vLLM's worker processes: no pytest here).

Each TP worker binds to one core, so the test module's own checks (a skip on a one-core affinity)
must not run in them.
"""

from __future__ import annotations

import os
from typing import Any

from maru.client import MaruHandler
from maru.vllm.keys import rank_keys

TP = 2


def __getattr__(name: str) -> Any:
    # Built on first access (by vLLM's connector factory in each worker process).
    if name == "EvictRankOneConnector":
        return _evict_rank_one_class()
    raise AttributeError(name)


def _evict_rank_one_class() -> type:
    from maru.vllm.connector import MaruKVConnector

    class EvictRankOneConnector(MaruKVConnector):
        """On rank 1 only: deletes that rank's key of the last chunk of this step's first load,
        right before loading, once per flag file (``test_evict_flag`` in the extra config)."""

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            meta = self._meta()
            flag = self._kv_transfer_config.kv_connector_extra_config.get("test_evict_flag")
            worker = self._worker
            if (
                worker is not None
                and worker.tp_rank == 1
                and meta is not None
                and meta.loads
                and flag
                and os.path.exists(flag)
            ):
                os.unlink(flag)
                with MaruHandler(self.maru_config.server_url, timeout_s=5) as h:
                    h.delete([rank_keys(meta.loads[0].chunks[-1].key, TP)[1]])
            super().start_load_kv(forward_context, **kwargs)

    return EvictRankOneConnector
