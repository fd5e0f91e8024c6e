"""Real parts that the tests and the benchmarks both start: a `mooncake_master` (mooncake_master.py)
and an openYuanrong datasystem worker (datasystem_worker.py), each on free loopback ports, stopped on
every path. Helpers only the tests use live in tests/support/."""
