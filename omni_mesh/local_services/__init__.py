"""Throwaway backend services on free loopback ports, for benchmarks, local runs and the tests: a
`mooncake_master` (mooncake_master.py) and an openYuanrong datasystem worker (datasystem_worker.py),
each stopped on every path. Helpers only the tests use live in tests/support/."""
