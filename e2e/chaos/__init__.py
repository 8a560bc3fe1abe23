"""The chaos suite's building blocks: generators of fuzzed specs and requests, the secrets scan, and the scenario
registry that `make chaos` (bench/chaos.py) runs at a larger scale than the e2e tests do."""
