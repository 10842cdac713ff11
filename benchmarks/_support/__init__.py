"""What benchmarks need that is not product code, shared with the tests: the daemon launcher
(``daemon``), a real redis-server (``redis_server``), certificates made at run time (``certs``),
fuzz inputs (``fuzzframes``, ``fuzzhttp``), the chaos soak's clients and ledger (``soak``), a
daemon's metrics read over HTTP (``metrics``), and the no-logic uvloop pump the serving scenarios
compare against (``pump``)."""
