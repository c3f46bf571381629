.PHONY: setup test simulate bench
setup:
	bash scripts/setup.sh
test:
	bash scripts/test.sh
simulate:
	bash scripts/simulate.sh
bench: setup
	.venv/bin/python benchmarks/bench_bookkeeping.py
