"""Code shared by the coordinator (`daemon/`), the agent (`agent/`) and the worker runtime that is not a
cross-process contract: the clock and the YAML config loader. Contracts between processes are in
`proto/`, which stays free of pydantic and YAML. `clock` is pure standard library (workers import it)."""
