"""Chunk movement between a paged KV cache and the Maru pool, independent of any inference engine.

* ``records``: the scheduler-to-worker contract (``ChunkRef``, ``RequestTransfer``, reports, slot
  mapping); torch-free, so a scheduler process imports it without torch.
* ``paths``: one class per data path (``CpuPath``, ``StagedPath``; ``device_path.PipelinedPath``)
  behind the ``DataPath`` interface; ``engine``: ``KVTransferEngine`` (reserve, gather, publish; look up, pin,
  scatter, unpin) on top of a path; ``loads``: the load handles; ``background``: loader and drain
  threads.

Nothing here imports vLLM. Import the submodules directly; this package imports nothing.
"""
