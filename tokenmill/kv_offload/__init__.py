"""KV cache tiers below the KV cache (host memory, disk) and the KV transfer of disaggregated
prefill (vLLM's SharedStorageConnector): config.py, block keys (block_hash.py), block files
(block_file.py), the scheduler's side (manager.py, host_index.py), the runner's (worker.py),
and the operations between them (ops.py)."""
