"""The asynchronous parameter server: shard actors, worker actors, a clock board and,
with two levels, local servers, on plain Ray actors (no collective), with async,
bounded-staleness (ssp) and synchronous (bsp) consistency. `run_parameter_server` runs
a `strategy.kind: ps` job."""
