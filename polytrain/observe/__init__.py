"""What a run shows and records: progress and ``metrics.jsonl`` with its TensorBoard/CSV twins (`metrics`), the
per-rank timeline (`timeline`), the stall watchdog (`watchdog`) on the ranks' shared board (`peer_board`), strict
JSON for every file written (`jsonfiles`), credentials masked wherever text leaves the process (`redact`), the
experiment trackers (`trackers/`) and the framework profilers (`profiling/`)."""
