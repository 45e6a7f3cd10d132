"""vLLM KV connector logic, free of vLLM imports: `engine_shim.vllm_connector`
adapts it to vLLM's `KVConnectorBase_V1`.

| file          | what                                                          |
|---------------|---------------------------------------------------------------|
| settings.py   | `ConnectorSettings`: the `kv_connector_extra_config` keys, checked |
| geometry.py   | `KVGeometry`: the paged KV shape both halves agree on          |
| parallel.py   | `Parallel`: a rank among the engine's TP ranks, MLA's one copy  |
| relay.py      | `RankRelay`: the TP leader's plans, handed to the other ranks  |
| metadata.py   | `LoadSpec`, `SaveSpec`, `ConnectorMeta`: scheduler -> workers  |
| lookups.py    | `Lookups`: sidecar lookups, answered now or on a thread        |
| scheduler.py  | `SchedulerSide`: what to load and save, per request            |
| worker.py     | `WorkerSide`: runs the loads and saves on a thread of its own  |
| layered.py    | `LayerJob`: a step's layer-wise load or save, and its splits    |
"""
