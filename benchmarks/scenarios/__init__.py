"""The serving benchmark's scenarios, one module each (benchmarks/serving.py runs them): each
has ``NAME`` (its results file and docs section), ``KEY`` (its key in that file), ``run(args)``
and ``markdown(results, args)``; ``common`` holds the loads, the measuring and the interleaved
rounds they share."""
