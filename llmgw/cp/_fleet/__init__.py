"""The fleet wing: what the fleet is and what it should be. The catalog
(`_catalog.py`, `_catalog_file.py`, `_engines.py`), the node registry and its
records (`_registry.py`, `_node_record.py`, `_fleet_state.py`, `_declare.py`,
`_progress.py`), the reconciler and its parts (`_reconciler.py`, `_launch.py`,
`_shards.py`, `_settle.py`, `_retiring.py`, `_wake.py`), the endpoint list the
router reads (`_endpoints.py`), leadership (`_leader.py`) and the fleet's metrics
(`_fleet_metrics.py`). It may import the weights and observation wings, never
the admin API, the pages or the assembly."""
